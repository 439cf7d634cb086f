"""Kill a worker mid-training under torchrun --max-restarts: the job resumes from
its last checkpoint and ends with exactly the weights of an uninterrupted run (CPU)."""

import os
import signal
import time

import torch

from course_utils.checkpoint import load_checkpoint
from course_utils.launch import find_rank_pid, run_script, start_script

ARGS = ["--epochs", "4", "--n-train", "1536", "--n-val", "64", "--batch-size", "32", "--workers", "0", "--no-progress"]


def test_killed_worker_resumes_bit_identical(tmp_path):
    run_script("train.py", [*ARGS, "--ckpt-dir", tmp_path / "straight"], nproc=2, timeout=600, echo=False)

    ckpt = tmp_path / "killed"
    job = start_script("train.py", [*ARGS, "--ckpt-dir", ckpt], nproc=2, torchrun_args=["--max-restarts=1"])
    deadline = time.time() + 300
    while not (ckpt / "last.pt").exists():  # the first epoch is done and saved...
        assert job.running() and time.time() < deadline, job.output[-3000:]
        time.sleep(0.2)
    victim = find_rank_pid(str(ckpt), rank=1)
    assert victim, "rank 1 not found"
    os.kill(victim, signal.SIGKILL)  # ...and rank 1 dies in the middle of a later one
    result = job.wait(timeout=600)
    assert "resumed from" in result.output, "torchrun restarted the workers, which resumed from the checkpoint"

    a = load_checkpoint(tmp_path / "straight" / "last.pt")
    b = load_checkpoint(ckpt / "last.pt")
    assert a["epoch"] == b["epoch"] == 4
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after the restart"
