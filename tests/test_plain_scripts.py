"""The take-home series: none of its scripts imports course_utils, and plain_resumable.py's checkpoint, resume and
stop on SIGUSR1 give the weights of an uninterrupted run bit for bit (CPU, no workers: the same arithmetic in every
run). Notebook 03 runs plain_single.py and plain_ddp.py and checks what they show; notebook 05 runs plain_resumable.py
with a killed rank and a requeued Slurm job; the bit-for-bit claims are proved here."""

import ast
import os
import signal

import pytest
import torch

from course_utils.launch import find_rank_pid, run_script, start_script
from course_utils.paths import SCRIPTS
from course_utils.results import plain_summary
from course_utils.waiting import wait_until

from references import ONE_THREAD

SERIES = ("plain_parts.py", "plain_single.py", "plain_ddp.py", "plain_resumable.py", "plain_fsdp.py")
TINY = ["--n-train", 1024, "--workers", 0]  # 8 steps an epoch on 2 ranks of batch 64
EPOCHS = 3


def test_the_series_is_plain_torch_and_each_script_a_diff_of_the_one_before():
    for name in SERIES:
        tree = ast.parse((SCRIPTS / name).read_text())
        imported = {(n.module or "") if isinstance(n, ast.ImportFrom) else a.name
                    for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom)) for a in n.names}
        assert not [m for m in imported if m.startswith("course_utils")], f"{name} stays the researcher's own"
    ddp = (SCRIPTS / "plain_ddp.py").read_text().splitlines()
    resumable = (SCRIPTS / "plain_resumable.py").read_text().splitlines()
    assert len(resumable) < 170, "plain_resumable.py reads in one sitting (plain_ddp.py and about 70 lines)"
    body = [line for line in ddp[ddp.index("import argparse"):] if line.strip()]
    # it adds lines, and changes only how the group is formed (a store prefix per torchrun restart)
    assert sum(line in resumable for line in body) >= 0.9 * len(body), "plain_resumable.py keeps plain_ddp.py's lines"


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """``straight()``: an uninterrupted run's final checkpoint; the run starts with the first test that asks, beside
    that test's own run (one thread a rank: the same arithmetic however the cores are shared)."""
    ckpt = tmp_path_factory.mktemp("straight") / "last.pt"
    job = start_script("plain_resumable.py", ["--epochs", EPOCHS, *TINY, "--ckpt", ckpt], nproc=2, env=ONE_THREAD)
    done = {}

    def final() -> dict:
        if not done:
            job.wait(timeout_s=300)
            done["state"] = torch.load(ckpt)
        return done["state"]

    yield final
    job.kill()


def assert_same_run(a, b):
    assert (a["epoch"], a["batch"]) == (b["epoch"], b["batch"]) == (EPOCHS, 0), "both ran to the end"
    for name, tensor in a["model"].items():
        assert torch.equal(tensor, b["model"][name]), f"{name} differs from the uninterrupted run's"
    for x, y in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(x["momentum_buffer"], y["momentum_buffer"]), "the momentum buffers too"


def wait_for(job, ckpt, mid_epoch: bool):
    def written():
        assert job.running(), job.output[-3000:]
        if ckpt.exists():
            state = torch.load(ckpt)
            return state if bool(state["batch"]) == mid_epoch else None
        return None

    return wait_until(written, 300, lambda: AssertionError(job.output[-3000:]), interval_s=0.02)


def test_sigusr1_to_one_rank_stops_both_at_one_step_and_the_next_start_ends_as_an_uninterrupted_run(tmp_path,
                                                                                                     straight):
    ckpt = tmp_path / "last.pt"
    args = ["--epochs", EPOCHS, *TINY, "--ckpt", ckpt, "--save-every", 1000]  # only epochs' ends and the stop save
    job = start_script("plain_resumable.py", args, nproc=2, env=ONE_THREAD)
    wait_for(job, ckpt, mid_epoch=False)  # epoch 0 is done ...
    os.kill(find_rank_pid(str(ckpt), rank=1), signal.SIGUSR1)  # ... and rank 1 alone gets the warning
    first = job.wait(timeout_s=300)
    stopped = torch.load(ckpt)
    assert "stopped on SIGUSR1" in first.output and plain_summary(first.output)["identical"], first.output
    assert stopped["epoch"] < EPOCHS and "; saved" in first.output, first.output
    second = run_script("plain_resumable.py", args, nproc=2, env=ONE_THREAD, timeout_s=300, echo=False)
    assert f"resumed from {ckpt}: epoch {stopped['epoch']}, after batch {stopped['batch']}" in second.output
    assert_same_run(straight(), torch.load(ckpt))


def test_a_rank_killed_mid_epoch_restarts_under_torchrun_and_ends_as_an_uninterrupted_run(tmp_path, straight):
    ckpt = tmp_path / "last.pt"
    args = ["--epochs", EPOCHS, *TINY, "--ckpt", ckpt, "--save-every", 3]
    job = start_script("plain_resumable.py", args, nproc=2, torchrun_args=["--max-restarts=1"], env=ONE_THREAD)
    state = wait_for(job, ckpt, mid_epoch=True)
    os.kill(find_rank_pid(str(ckpt), rank=1), signal.SIGKILL)  # as the out-of-memory killer or a failing node would
    done = job.wait(timeout_s=300)
    assert "resumed from" in done.output and state["batch"] % 3 == 0, done.output[-3000:]
    assert_same_run(straight(), torch.load(ckpt))


def test_the_take_home_claims_print_one_line_each_and_a_wrong_run_is_named(capsys):
    from course_utils.checks import check_plain_ddp
    from course_utils.claims import ClaimFailed
    from course_utils.launch import RunResult

    def run(text):
        return RunResult(["python"], 0, text, 1.0)

    single = run("epoch 0: loss 2.3000 (16 steps of 64 images on cpu)\n"
                 "epoch 1: loss 1.9000 (16 steps of 64 images on cpu)\n")
    ddp = ("epoch 0: loss 2.3100 (8 steps of 2 x 64 images on 2 ranks)\n"
           "epoch 1: loss 2.0000 (8 steps of 2 x 64 images on 2 ranks)\n"
           "done: 2 ranks, 2 per node; weights identical on every rank: True\n")
    check_plain_ddp(single, run(ddp), 2)
    shown = capsys.readouterr().out.splitlines()
    assert len(shown) == 5 and all(line.startswith("✓ ") for line in shown), shown
    with pytest.raises(ClaimFailed, match="identical weights"):
        check_plain_ddp(single, run(ddp.replace("rank: True", "rank: False")), 2)
    with pytest.raises(ClaimFailed, match="1/2 of an epoch's batches"):
        check_plain_ddp(single, run(ddp.replace("(8 steps", "(16 steps")), 2)


def test_a_requeued_job_stopped_at_an_epoch_s_last_batch_resumes_at_the_next_epoch_s_start(tmp_path):
    """plain_resumable.py saves a finished epoch as the start of the next: a warning that lands on an epoch's last
    batch stops "in epoch 0, after batch 8" and the next start resumes at "epoch 1, after batch 0", the same step.
    Any other step is not."""
    from pathlib import Path

    from course_utils.checks import check_requeued_job
    from course_utils.claims import ClaimFailed

    ckpt = Path("runs/ddp-requeue-7/last.pt")
    record = {"JobState": "COMPLETED", "Restarts": "1"}

    def log(stopped, resumed):
        return (f"stopped on SIGUSR1 in epoch 0, after batch {stopped}; saved {ckpt}\n"
                "done: 4 ranks, 2 per node; weights identical on every rank: True\n"
                f"resumed from {ckpt}: epoch {resumed}\n"
                "epoch 1: loss 2.2674 (8 steps of 4 x 16 images on 4 ranks)\n"
                "done: 4 ranks, 2 per node; weights identical on every rank: True\n")

    check_requeued_job(record, log(8, "1, after batch 0"), ckpt, 2)
    check_requeued_job(record, log(5, "0, after batch 5").replace("epoch 1: loss", "epoch 0: loss 2.3\nepoch 1: loss"),
                       ckpt, 2)
    for stopped, resumed in ((5, "1, after batch 0"), (8, "0, after batch 0"), (5, "0, after batch 4")):
        with pytest.raises(ClaimFailed, match="resumed from that step"):
            check_requeued_job(record, log(stopped, resumed), ckpt, 2)
