"""A pytest plugin for ``make gpu-check`` (``-p record_executed``): each notebook run under nbval is written to
COURSE_EXECUTED_DIR with the outputs its cells printed, rewritten after each cell, so a run stopped or crashed
keeps what it showed (a forked rank's crash report included) and ``make site`` can show the GPU run. Labelled
COURSE_EXECUTED_LABEL, with the number of cells that raised."""

import os
from pathlib import Path

import pytest


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After each notebook cell nbval ran: the notebook so far, with the cell's outputs, in COURSE_EXECUTED_DIR."""
    yield
    folder = os.environ.get("COURSE_EXECUTED_DIR")
    if not folder or call.when != "call" or not hasattr(item, "test_outputs") or not hasattr(item, "cell"):
        return
    import nbformat

    nb = item.parent.nb
    item.cell.outputs = list(item.test_outputs or [])  # nbval's records are nbformat outputs already
    errors = sum(any(o.get("output_type") == "error" for o in c.get("outputs", [])) for c in nb.cells
                 if c.cell_type == "code")
    label = os.environ.get("COURSE_EXECUTED_LABEL", "Executed under nbval")
    nb.metadata["course_run"] = {"label": label + (f"; {errors} cell(s) raised" if errors else ""), "errors": errors}
    target = Path(folder) / Path(str(item.parent.fspath)).name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    nbformat.write(nb, str(partial))
    partial.replace(target)
