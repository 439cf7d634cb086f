"""Signal one worker mid-training: every rank stops at the same step, and the rerun ends with exactly
the weights (and per-epoch losses) of an uninterrupted run (CPU, workers=0). Notebook 05 kills a worker
after a mid-epoch step checkpoint and checks the bit-identical resume: that check lives there."""

import os
import signal

import torch

from course_utils.checkpoint import load_checkpoint
from course_utils.launch import find_rank_pid, run_script, start_script
from course_utils.results import parse_result
from course_utils.waiting import wait_until

from references import ONE_THREAD, RESUME_ARGS


def wait_for_checkpoint(job, ckpt, mid_epoch: bool):
    def written() -> dict | None:
        assert job.running(), job.output[-3000:]
        if (ckpt / "last.pt").exists():
            state = load_checkpoint(ckpt / "last.pt")
            if bool(state["in_epoch"]) == mid_epoch:
                return state
        return None

    return wait_until(written, 300, lambda: AssertionError(job.output[-3000:]), interval_s=0.05)


def assert_identical(a, b):
    assert a["epoch"] == b["epoch"] == 4 and a["in_epoch"] is None and b["in_epoch"] is None
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs after the restart"
    assert [h["train_loss"] for h in a["history"]] == [h["train_loss"] for h in b["history"]]


def test_a_signal_to_one_rank_stops_all_at_the_same_step_and_the_rerun_is_identical(tmp_path):
    # the uninterrupted run beside the signalled one (2 ranks x batch 32 over 1536 images: 24 optimiser steps an
    # epoch; one thread per rank, so the same arithmetic however the cores are shared)
    straight_dir = tmp_path / "uninterrupted"
    straight = start_script("train.py", [*RESUME_ARGS, "--ckpt-dir", straight_dir], nproc=2, env=ONE_THREAD)
    ckpt = tmp_path / "signalled"
    args = [*RESUME_ARGS, "--ckpt-dir", ckpt]  # no step checkpoints: only the stop writes one mid-epoch
    job = start_script("train.py", args, nproc=2, env=ONE_THREAD)
    wait_for_checkpoint(job, ckpt, mid_epoch=False)  # epoch 0 is done...
    os.kill(find_rank_pid(str(ckpt), rank=1), signal.SIGUSR1)  # ...rank 1 alone gets the warning
    first = job.wait(timeout_s=300)
    assert parse_result(first.output)["stopped"], first.output[-3000:]
    assert "stopped on request (SIGUSR1)" in first.output
    stopped = load_checkpoint(ckpt / "last.pt")
    assert stopped["epoch"] < 4, "it stopped early, not at the end"
    second = run_script("train.py", args, nproc=2, env=ONE_THREAD, timeout_s=600, echo=False)
    assert "resumed from" in second.output and not parse_result(second.output)["stopped"]
    reference = parse_result(straight.wait(timeout_s=600).output)
    assert_identical(load_checkpoint(straight_dir / "last.pt"), load_checkpoint(ckpt / "last.pt"))
    assert parse_result(second.output)["train_loss"] == reference["train_loss"]
