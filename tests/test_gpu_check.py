"""`make gpu-check`'s runner, end to end on this CPU machine (its --cpu mode): the notebooks run under
nbval in their own processes, the ladder and the matmul table are measured, and the report says
what passed and what failed."""

import json
import sys

import nbformat

from course_utils.launch import run_script
from course_utils.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402


def test_the_cpu_mode_writes_the_whole_report(tmp_path):
    run = run_script("gpu_check.py", ["--cpu", "--notebooks", "00", "--out", tmp_path], timeout_s=600, echo=False)
    report = json.loads((tmp_path / "report.json").read_text())
    (notebook,) = report["notebooks"]
    assert notebook["notebook"] == "00_environment.ipynb" and notebook["passed"] and notebook["cells_passed"] > 5
    ladder = report["ladder"]["rungs"]
    assert ladder[0]["rung"] == "fp32 textbook (defaults)" and ladder[0]["images_per_s"] > 0, \
        "the textbook loop, measured in the same run as the optimisations"
    # the ladder's rule: a rung is kept when it is at least as fast as the best configuration before it
    best, measured = 0.0, [r for r in ladder if not r["status"].startswith("skipped")]
    assert len(measured) >= 3, ladder
    for r in measured:
        assert (r["status"] == "kept") == (r["images_per_s"] >= best), (r, best)
        assert abs(r["speedup"] - r["images_per_s"] / ladder[0]["images_per_s"]) < 1e-9, r
        best = max(best, r["images_per_s"]) if r["status"] == "kept" else best
    assert abs(report["ladder"]["best_speedup"] - best / ladder[0]["images_per_s"]) < 1e-9, "from the measurements"
    assert {r["format"] for r in report["matmul"]} == {"fp32", "bf16"}
    assert 0 < report["training_share"]["share"] < 1, "training runs below the matmul peak"
    text = (tmp_path / "report.md").read_text()
    assert "| 00_environment.ipynb | pass |" in text and "## Single-device ladder (cnn)" in text
    assert run.returncode == 0


def test_a_failing_notebook_is_reported_as_failed_and_the_run_goes_on(tmp_path):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('fine')"),
                                         nbformat.v4.new_code_cell("assert 1 + 1 == 3, 'the lesson is wrong'")])
    path = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, path)
    result = gpu_check.run_notebook(path, "ci", 300, 60, tmp_path)
    assert not result["passed"] and result["cells_passed"] == 1 and result["cells_failed"] == 1
    assert "the lesson is wrong" in (tmp_path / "99_broken.log").read_text()
    skipped = {**result, "notebook": "98_late.ipynb", "not_run": True, "cells_passed": 0, "cells_failed": 0}
    text = gpu_check.markdown({
        "hardware": "x", "started": "now", "profile": "ci", "torch": "t", "seconds": 1.0, "notebooks": [result, skipped],
        "ladder_model": "cnn", "ladder": {"error": "not run"}, "matmul": [], "training_share": {}})
    assert "| 99_broken.ipynb | FAIL | 1 | 1 |" in text and "| 98_late.ipynb | not run (budget) |" in text
