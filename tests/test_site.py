"""make site's builder (scripts/build_site.py): links as they work in the site, and Sphinx with MyST-NB rendering
an executed notebook's outputs without executing anything. The whole site is built and checked in a browser by
make site itself (scripts/check_site.py), not here: it executes every notebook."""

import importlib.util
import json
import os
import subprocess
import sys

from course_utils.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("build_site", REPO_ROOT / "scripts" / "build_site.py")
build_site = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(build_site)

PAGES = {"notebooks/03_ddp_one_node.ipynb": "notebooks/03_ddp_one_node.ipynb", "README.md": "readme.md",
         "slurm/README.md": "slurm.md"}


def test_links_lead_to_pages_of_the_site_or_name_the_file_in_a_clone():
    text = ("see [notebook 03](03_ddp_one_node.ipynb#4-scaling), [the patterns](../slurm/README.md), "
            "[train.py](../scripts/train.py), [`scripts/train.py`](../scripts/train.py), [here](#top) and "
            "[PyTorch](https://pytorch.org)")
    out = build_site.site_links(text, REPO_ROOT / "notebooks", "notebooks", PAGES)
    assert "[notebook 03](03_ddp_one_node.ipynb#4-scaling)" in out and "[the patterns](../slurm.md)" in out
    assert "train.py (`scripts/train.py`)" in out and "[`scripts/train.py`]" not in out and "`scripts/train.py`" in out
    assert "[here](#top)" in out and "[PyTorch](https://pytorch.org)" in out
    readme = build_site.site_links("[03](notebooks/03_ddp_one_node.ipynb) [guide](slurm/README.md)", REPO_ROOT, "",
                                   PAGES)
    assert readme == "[03](notebooks/03_ddp_one_node.ipynb) [guide](slurm.md)"


def test_an_executed_notebook_is_rendered_with_its_outputs_and_its_label_nothing_executed(tmp_path):
    executed = tmp_path / "executed"
    executed.mkdir()
    nb = {"cells": [{"cell_type": "markdown", "id": "t", "metadata": {}, "source": ["# 03 · A title\n"]},
                    {"cell_type": "code", "id": "c", "metadata": {}, "execution_count": 1,
                     "source": ["raise SystemExit('executed at build time')"],
                     "outputs": [{"output_type": "stream", "name": "stdout", "text": ["4 ranks: 812 images/s\n"]}]}],
          "metadata": {"course_run": {"label": "Executed 2026-11-25 on CPU X (2 cores), profile ci"},
                       "kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}},
          "nbformat": 4, "nbformat_minor": 5}
    (executed / "03_ddp_one_node.ipynb").write_text(json.dumps(nb))
    index = build_site.build(executed, tmp_path / "site")
    page = (index.parent / "notebooks" / "03_ddp_one_node.html").read_text()
    assert "4 ranks: 812 images/s" in page, "the stored output is on the page"
    assert "Executed 2026-11-25 on CPU X (2 cores), profile ci" in page
    # beside the CPU run, the notebook's latest GPU run on record (records/gpu: the H200's of 2026-11-26)
    assert "Latest GPU run: stopped (budget) in the full profile, 11 of 14 code cells, 110 s" in page and "NVIDIA H200" in page, page
    assert "executed at build time" in page and "SystemExit" not in page.split("executed at build time")[1][:200]
    assert "03_ddp_one_node.html" in index.read_text(), "the index lists the notebook"


def test_without_a_built_site_the_browser_check_says_what_to_do(tmp_path):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "check_site.py"), str(tmp_path)],
                         capture_output=True, text=True)
    assert out.returncode == 2 and "build the site first (make site)" in out.stderr


def test_the_gpu_run_of_a_notebook_is_taken_in_place_of_a_cpu_run(tmp_path):
    """make site shows what make gpu-check executed (labelled with its hardware) where that is newer than the
    notebook; a copy older than the notebook is stale and a CPU run replaces it: make test's, where there is one."""
    import os

    gpu, executed = tmp_path / "gpu", tmp_path / "executed"
    gpu.mkdir()
    sources = [REPO_ROOT / "notebooks" / name for name in ("00_environment.ipynb", "03_ddp_one_node.ipynb")]
    for source, age in zip(sources, (+60, -60)):  # a minute after the source was written; a minute before
        run = gpu / source.name
        run.write_text('{"metadata": {"course_run": {"label": "Executed on NVIDIA H200"}}}')
        os.utime(run, (source.stat().st_mtime + age,) * 2)
    assert build_site.take_runs(sources, gpu, executed) == ["00_environment.ipynb"]
    assert "H200" in (executed / "00_environment.ipynb").read_text() and not (executed / "03_ddp_one_node.ipynb").exists()
    assert build_site.take_runs(sources, gpu, executed) == [], "already taken"
    # make test's CPU runs, newer still, fill what the site lacks and never replace the GPU run
    tests = tmp_path / "test-runs"
    tests.mkdir()
    for source in sources:
        run = tests / source.name
        run.write_text('{"metadata": {"course_run": {"label": "Executed on CPU X (2 cores), under make test"}}}')
        os.utime(run, (source.stat().st_mtime + 120,) * 2)
    assert build_site.take_runs(sources, tests, executed, stale_only=True) == ["03_ddp_one_node.ipynb"]
    assert "H200" in (executed / "00_environment.ipynb").read_text()


def test_make_test_records_the_notebooks_it_runs_for_the_site(tmp_path):
    """make test sets COURSE_EXECUTED_DIR (the Makefile): the suite's conftest then loads the plugin that writes
    each notebook with its outputs there (scripts/record_executed.py; tests/test_gpu_check.py runs it on a
    notebook), which make site takes where it has no current run of its own."""
    import os

    makefile = (REPO_ROOT / "Makefile").read_text()
    test_rule = makefile[makefile.index("\ntest:"):].split("\n\n")[0]
    assert "COURSE_EXECUTED_DIR=$(CURDIR)/runs/test-executed" in test_rule, test_rule
    out = subprocess.run([sys.executable, "-m", "pytest", "--co", "-q", "--trace-config", "-p", "no:cacheprovider",
                          "tests/test_sizing.py"], cwd=REPO_ROOT, capture_output=True, text=True,
                         env={**os.environ, "COURSE_EXECUTED_DIR": str(tmp_path)})
    assert out.returncode == 0 and "record_executed" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]



def test_a_figure_of_the_course_s_helpers_is_shown_once_in_a_cell_run_as_nbval_runs_it():
    """nbval runs each cell with store_history=False, where a trailing `;` does not silence a returned value: a
    helper that returned its Figure put every chart twice into the executed copies and the site. In a real kernel,
    with the notebooks' inline backend: one image per chart."""
    from jupyter_client.manager import start_new_kernel

    km, kc = start_new_kernel(kernel_name="python3", env={**os.environ, "PYTHONPATH": str(REPO_ROOT / "notebooks")})
    try:
        code = ("from course_utils.plots import bar_chart, line_chart\n"
                "bar_chart(['a', 'b'], [1.0, 2.0], 'x', 'two bars');\n"
                "line_chart([1, 2], {'y': [3, 4]}, 'x', 'y', 'a line')")
        msg_id = kc.execute(code, store_history=False)
        images, errors = 0, []
        while True:
            msg = kc.get_iopub_msg(timeout=120)
            if msg["parent_header"].get("msg_id") != msg_id:
                continue
            kind, content = msg["msg_type"], msg["content"]
            if kind in ("display_data", "execute_result") and "image/png" in content.get("data", {}):
                images += 1
            elif kind == "error":
                errors.append(content["evalue"])
            elif kind == "status" and content["execution_state"] == "idle":
                break
        assert not errors and images == 2, (images, errors)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
