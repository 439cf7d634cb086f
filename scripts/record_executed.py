"""A pytest plugin for ``make gpu-check`` (``-p record_executed``): each notebook run under nbval is written to
COURSE_EXECUTED_DIR with the outputs its cells printed, rewritten after each cell, so a run stopped or crashed
keeps what it showed (a forked rank's crash report included) and ``make site`` can show the GPU run. Labelled
COURSE_EXECUTED_LABEL, with the number of cells that raised and, until the last cell has run, where it stopped."""

import os
from pathlib import Path

import pytest


def run_label(label: str, errors: int, ran: int, cells: int) -> str:
    """What a page of the site says of the run: written after each cell, so a run cut short (gpu-check's time ran
    out, the job died) is labelled with the cells it reached, not as a whole run."""
    if ran < cells:
        label += f"; stopped after code cell {ran} of {cells}: the cells below it did not run"
    return label + (f"; {errors} cell(s) raised" if errors else "")


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
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = sum(any(o.get("output_type") == "error" for o in c.get("outputs", [])) for c in code)
    ran = next(i for i, c in enumerate(code, 1) if c is item.cell)
    label = run_label(os.environ.get("COURSE_EXECUTED_LABEL", "Executed under nbval"), errors, ran, len(code))
    nb.metadata["course_run"] = {"label": label, "errors": errors, "cells_ran": ran, "cells": len(code)}
    target = Path(folder) / Path(str(item.parent.fspath)).name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    nbformat.write(nb, str(partial))
    partial.replace(target)
