"""`make lab` (the README's first command) really serves the course in JupyterLab."""

import json
import os
import shutil
import signal
import subprocess
import urllib.request
from pathlib import Path

import pytest

from course_utils.process_group import free_port
from course_utils.paths import REPO_ROOT
from course_utils.waiting import wait_until


def _group(pgid: int) -> list[int]:
    """The processes of process group ``pgid`` (make's session: make and what it started)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # ended meanwhile
            continue
        if int(fields[2]) == pgid:
            pids.append(int(stat.parent.name))
    return pids


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as response:
        return response.status, response.read().decode()


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_make_lab_serves_the_notebooks(tmp_path):
    """... and, while the practice cluster is up (make cluster: its slurm.conf in COURSE_SLURM_DIR), hands its
    config to the notebooks (SLURM_CONF in the server's environment, which its kernels inherit), so that their
    Slurm cells submit to it."""
    port, token = free_port(), "course-test-token"
    args = f"--no-browser --port={port} --ServerApp.token={token} --ServerApp.open_browser=False"
    (tmp_path / "slurm.conf").write_text("# the practice cluster's config, while it is up\n")
    env = {k: v for k, v in os.environ.items() if k != "SLURM_CONF"}  # a Slurm of the machine's own would win
    proc = subprocess.Popen(["make", "-C", str(REPO_ROOT), "lab", f"LAB_ARGS={args}"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**env, "COURSE_SLURM_DIR": str(tmp_path)})
    base = f"http://127.0.0.1:{port}"
    try:
        def answer() -> tuple[int, str] | None:
            assert proc.poll() is None, proc.stdout.read().decode()[-3000:]
            try:
                return _get(f"{base}/api/status?token={token}")
            except OSError:
                return None

        status, body = wait_until(answer, 120, "JupyterLab did not answer within 120 s", interval_s=0.5)
        assert status == 200 and "started" in json.loads(body)
        status, body = _get(f"{base}/api/contents/notebooks?token={token}")
        names = {item["name"] for item in json.loads(body)["content"]}
        assert {"00_environment.ipynb", "01_single_device_training.ipynb"} <= names
        assert not [n for n in names if n.endswith(".egg-info")], f"build metadata among the notebooks: {names}"
        status, body = _get(f"{base}/lab/api/settings/@jupyterlab/apputils-extension:notification?token={token}")
        defaults = json.loads(body)["schema"]["properties"]
        assert defaults["fetchNews"]["default"] == "false", "the first view is the course, not a news prompt"
        status, page = _get(f"{base}/lab?token={token}")
        assert status == 200 and "JupyterLab" in page
        status, body = _get(f"{base}/api/kernelspecs?token={token}")
        assert "python3" in json.loads(body)["kernelspecs"]
        servers = [pid for pid in _group(proc.pid) if b"jupyter" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        environ = Path(f"/proc/{servers[0]}/environ").read_bytes().split(b"\0")
        assert f"SLURM_CONF={tmp_path / 'slurm.conf'}".encode() in environ, "make lab points the notebooks at it"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
