"""Each notebook run under nbval, written with the outputs its cells printed to COURSE_EXECUTED_DIR, rewritten
after each cell: a run stopped or crashed keeps what it showed (a forked rank's crash report included), and
``make site`` shows the run instead of executing the notebook again. A pytest plugin that records whenever
COURSE_EXECUTED_DIR is set: ``make gpu-check`` loads it (``-p record_executed``, labelled with the GPU and the
date) and the root conftest.py registers it for ``make test`` (labelled with the CPU, the CI profile and the
date). Labelled COURSE_EXECUTED_LABEL, else from this machine; with the number of cells that raised and, until
the last cell has run, where it stopped."""

import datetime
import functools
import os
from pathlib import Path

import pytest


def run_label(label: str, errors: int, ran: int, cells: int) -> str:
    """What a page of the site says of the run: written after each cell, so a run cut short (gpu-check's time ran
    out, the job died) is labelled with the cells it reached, not as a whole run."""
    if ran < cells:
        label += f"; stopped after code cell {ran} of {cells}: the cells below it did not run"
    return label + (f"; {errors} cell(s) raised" if errors else "")


def empty_display(output) -> bool:
    """A display that shows nothing: every format it carries is empty text."""
    data = output.get("data") or {}
    return output.get("output_type") == "display_data" and bool(data) and all(
        isinstance(v, str) and not v.strip() for v in data.values())


@functools.cache
def machine() -> tuple[str, str]:
    """What ran the notebooks, as a run's label names it (the GPUs, else the CPU and its cores), and the profile."""
    from course_utils import current_profile
    from course_utils.hardware import environment_report

    env = environment_report()
    gpus = env.get("gpus") or []
    hardware = f"{len(gpus)} x {gpus[0]['name']}" if gpus else f"CPU {env['cpu']} ({env['cores_usable']} cores)"
    return hardware, current_profile()


def executed_label(by: str = "") -> str:
    """``Executed DATE on HARDWARE, profile P`` and ``by`` (who ran it), with what the CI profile's sizes mean: the
    label of this machine's runs, here (make test) and in scripts/build_site.py."""
    from course_utils.exercises import solutions_enabled

    hardware, profile = machine()
    answers = solutions_enabled()
    return (f"Executed {datetime.date.today().isoformat()} on {hardware}, profile {profile}{by}"
            + (" (the CI profile's small sizes: a GPU run in the full profile prints the workshop's numbers)"
               if profile == "ci" else "")
            + ("; each exercise checked with the reference answer (course_utils/solutions.py) in place of its "
               "empty cell" if answers else ""))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """After nbval ran a notebook cell: the notebook so far, with the cell's outputs, in COURSE_EXECUTED_DIR. Other
    tests are left alone."""
    yield
    folder = os.environ.get("COURSE_EXECUTED_DIR")
    if not folder or call.when != "call" or not hasattr(item, "test_outputs") or not hasattr(item, "cell"):
        return
    import nbformat

    nb = item.parent.nb
    # nbval's records are nbformat outputs already; a status line (course_utils.progress.StatusLine) is an empty
    # display whose updates nbval does not keep: left out, as it is gone from a live notebook when the work ends
    item.cell.outputs = [o for o in item.test_outputs or [] if not empty_display(o)]
    code = [c for c in nb.cells if c.cell_type == "code"]
    errors = sum(any(o.get("output_type") == "error" for o in c.get("outputs", [])) for c in code)
    ran = next(i for i, c in enumerate(code, 1) if c is item.cell)
    label = os.environ.get("COURSE_EXECUTED_LABEL") or executed_label(", under make test")
    label = run_label(label, errors, ran, len(code))
    nb.metadata["course_run"] = {"label": label, "errors": errors, "cells_ran": ran, "cells": len(code)}
    target = Path(folder) / Path(str(item.parent.fspath)).name
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    nbformat.write(nb, str(partial))
    partial.replace(target)
