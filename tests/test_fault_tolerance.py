"""Kill a worker mid-training under torchrun --max-restarts: the job resumes from
its last checkpoint and ends with exactly the weights of an uninterrupted run (CPU)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from course_utils.checkpoint import load_checkpoint
from course_utils.dist import free_port
from course_utils.launch import REPO_ROOT, child_env

ARGS = ["--epochs", "4", "--n-train", "1536", "--n-val", "64", "--batch-size", "32", "--workers", "0", "--no-progress"]


def torchrun(ckpt: Path, restarts: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=1", "--nproc-per-node=2",
           f"--max-restarts={restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}",
           str(REPO_ROOT / "scripts" / "train.py"), *ARGS, "--ckpt-dir", str(ckpt)]
    return subprocess.Popen(cmd, env=child_env({"OMP_NUM_THREADS": "1"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def worker_pid(ckpt: Path, rank: int) -> int | None:
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if str(ckpt).encode() in cmdline and b"torch.distributed.run" not in cmdline \
                and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def test_killed_worker_resumes_bit_identical(tmp_path):
    straight = torchrun(tmp_path / "straight", restarts=0)
    out_straight, _ = straight.communicate(timeout=600)
    assert straight.returncode == 0, out_straight[-3000:]

    ckpt = tmp_path / "killed"
    job = torchrun(ckpt, restarts=1)
    deadline = time.time() + 300
    while not (ckpt / "last.pt").exists():  # the first epoch is done and saved...
        assert job.poll() is None and time.time() < deadline, job.stdout.read()[-3000:] if job.poll() else "timeout"
        time.sleep(0.2)
    victim = worker_pid(ckpt, rank=1)
    assert victim, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)  # ...and rank 1 dies in the middle of a later one
    out, _ = job.communicate(timeout=600)
    assert job.returncode == 0, out[-3000:]
    assert "resumed from" in out, "torchrun restarted the workers, which resumed from the checkpoint"

    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(ckpt / "last.pt")
    assert a["epoch"] == b["epoch"] == 4
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after the restart"
