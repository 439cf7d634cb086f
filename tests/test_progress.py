"""course_utils.progress.StatusLine: progress while long work runs, none of it left in the executed copy."""

import pytest

from course_utils.progress import StatusLine


def test_outside_a_notebook_each_update_is_a_line(capsys):
    with StatusLine() as status:
        for rung in ("fp32", "+ workers"):
            status(f"{rung} measured")
    assert capsys.readouterr().out == "fp32 measured\n+ workers measured\n"


def test_in_a_kernel_each_update_replaces_the_last_and_the_cell_keeps_only_its_result(tmp_path):
    """A kernel as nbval and make site run it: the updates are one display, emptied when the work ends."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from course_utils.progress import StatusLine\n"
        "with StatusLine() as status:\n"
        "    for k in range(3):\n"
        "        status(f'step {k} of 3')\n"
        "print('the result')")])
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = nb.cells[0].outputs
    texts = [o.get("text", "") or o.get("data", {}).get("text/plain", "") for o in outputs]
    assert not any("step" in t for t in texts), outputs
    assert [o["output_type"] for o in outputs] == ["display_data", "stream"] and texts[1] == "the result\n", outputs


def test_under_nbval_the_executed_copy_keeps_no_progress_line(tmp_path):
    """nbval, which writes the executed copies (scripts/record_executed.py), drops display updates: what it keeps
    of a status line is the display as it was created, empty, and the copy leaves that out."""
    import json
    import os
    import subprocess
    import sys

    import nbformat

    from course_utils.paths import REPO_ROOT

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(
        "from course_utils.progress import StatusLine\n"
        "with StatusLine() as status:\n"
        "    status('step 1 of 1')\n"
        "print('the result')")])
    nbformat.write(nb, tmp_path / "status.ipynb")
    env = {**os.environ, "COURSE_EXECUTED_DIR": str(tmp_path / "executed"),
           "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "scripts"), str(REPO_ROOT / "notebooks")])}
    run = subprocess.run([sys.executable, "-m", "pytest", "--nbval-lax", "-p", "record_executed",
                          "-p", "no:cacheprovider", "-q", str(tmp_path / "status.ipynb")],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert run.returncode == 0, run.stdout[-2000:]
    (cell,) = json.loads((tmp_path / "executed" / "status.ipynb").read_text())["cells"]
    shown = json.dumps(cell["outputs"])
    assert "step 1" not in shown and "the result" in shown, cell["outputs"]
    assert [o["output_type"] for o in cell["outputs"]] == ["stream"], "no empty display left"
