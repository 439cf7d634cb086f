"""envs/ and data/: generated from the one set of pins, valid, and the staging helper works."""

import os
import shutil
import subprocess
import sys

import pytest
import yaml

from course_utils.paths import REPO_ROOT

SHELL = sorted(REPO_ROOT.glob("envs/**/*.sh")) + [REPO_ROOT / "data" / "stage.sh"]


def test_environment_files_are_generated_from_pyproject():
    out = subprocess.run([sys.executable, "envs/generate.py", "--check"], cwd=REPO_ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("cluster", ["ft3", "frontera"])
def test_environment_file_parses_and_the_setup_installs_the_pins_with_the_constraints(cluster):
    """conda brings Python and pip; the pins reach the cluster with constraints.txt, torch first in the build the
    driver chooses (envs/cuda_build.py), so nothing resolves afresh there."""
    spec = yaml.safe_load((REPO_ROOT / "envs" / cluster / "environment.yml").read_text())
    assert spec["dependencies"] == ["python=3.11", "pip"]
    setup = (REPO_ROOT / "envs" / "setup_conda.sh").read_text()
    installs = [line for line in setup.splitlines() if line.startswith("python -m pip install")]
    assert installs and all('-c "$ROOT/constraints.txt"' in line for line in installs), installs
    assert "$TORCH_BUILD $TORCH_PINS" in installs[0] and '-e "${ROOT}[lab,test]"' in installs[1]


@pytest.mark.parametrize("driver, build, status", [
    ("580.65.06", [], 0),                                                        # CUDA 13: PyPI's wheel
    ("575.57.08", ["--extra-index-url", "https://download.pytorch.org/whl/cu126"], 0),
    ("525.60.13", ["--extra-index-url", "https://download.pytorch.org/whl/cu126"], 0),  # CUDA 12's oldest
    ("470.82.01", [], 2),                                                        # too old for either
    (None, [], 0),                                                               # no driver seen: PyPI's, said so
])
def test_the_torch_build_is_chosen_from_the_driver(driver, build, status, monkeypatch):
    sys.path.insert(0, str(REPO_ROOT / "envs"))
    try:
        import cuda_build
    finally:
        sys.path.pop(0)
    monkeypatch.delenv("COURSE_TORCH_INDEX", raising=False)
    args, why, code = cuda_build.choose(driver)
    assert (args, code) == (build, status) and why
    if driver is None:
        assert "COURSE_CUDA_DRIVER" in why
    monkeypatch.setenv("COURSE_TORCH_INDEX", "https://download.pytorch.org/whl/cu128")
    if build:
        assert cuda_build.choose(driver)[0] == ["--extra-index-url", "https://download.pytorch.org/whl/cu128"]
    monkeypatch.delenv("COURSE_TORCH_INDEX")
    out = subprocess.run([sys.executable, str(REPO_ROOT / "envs" / "cuda_build.py"), "--driver", driver or "590.1"],
                         capture_output=True, text=True)
    assert out.stdout.strip() == (" ".join(build) if driver else "") and len(out.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("script", SHELL, ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_shell_scripts_parse(script):
    assert subprocess.run(["bash", "-n", str(script)]).returncode == 0


def test_shell_scripts_pass_shellcheck():
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; the suite installs it as root)")
    out = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SHELL)], capture_output=True, text=True,
                         cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout


def test_setup_outside_the_cluster_says_where_to_run(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("STORE", "WORK", "COURSE_CONDA_ENV")}
    out = subprocess.run(["bash", str(REPO_ROOT / "envs" / "ft3" / "setup.sh")], capture_output=True, text=True,
                         env=env)
    assert out.returncode != 0 and "run this on FT3" in out.stderr


def test_stage_copies_to_node_local_and_points_course_data_there(tmp_path):
    (tmp_path / "store" / "MNIST" / "raw").mkdir(parents=True)
    (tmp_path / "store" / "MNIST" / "raw" / "x.gz").write_bytes(b"123")
    script = f"source {REPO_ROOT}/data/stage.sh mnist && echo COURSE_DATA=$COURSE_DATA"
    env = {**os.environ, "COURSE_DATA": str(tmp_path / "store"), "TMPDIR": str(tmp_path / "node"), "SLURM_JOB_ID": "7"}
    out = subprocess.run(["bash", "-c", script], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    staged = tmp_path / "node" / "course-data-7"
    assert f"COURSE_DATA={staged}" in out.stdout
    assert (staged / "MNIST" / "raw" / "x.gz").read_bytes() == b"123"
    missing = subprocess.run(["bash", "-c", f"source {REPO_ROOT}/data/stage.sh cifar10"], capture_output=True,
                             text=True, env=env)
    assert missing.returncode != 0 and "python -m course_utils.data download cifar10" in missing.stderr
