"""The claims of the notebooks' runs, one call each after the run's output (notebooks 03-05): what train.py under
torchrun showed, and what the take-home scripts (scripts/plain_*.py) and their job files did."""

from __future__ import annotations

from pathlib import Path

from .claims import verify
from .launch import RunResult
from .results import plain_epochs, plain_steps, plain_summary


def check_ddp_run(run: RunResult, result: dict, run_dir: Path, ranks: int) -> None:
    """train.py under torchrun on ``ranks`` ranks, its checkpoints in ``run_dir/ckpt``, its TensorBoard files in
    ``run_dir/tb``."""
    losses = result["train_loss"]
    saved = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    verify([
        (f"train.py found torchrun's {ranks} ranks", result["world_size"] == ranks
         and f"launcher=torchrun rank=0/{ranks}" in run.output),
        (f"the loss fell under DDP: {losses[0]:.3f} -> {losses[-1]:.3f}", losses[-1] < losses[0]),
        ("every rank ended with the same weights: DDP averaged the same gradients everywhere", result["ranks_agree"]),
        ("only rank 0 reported", sum(line.startswith("RESULT") for line in run.lines) == 1),
        (f"only rank 0 wrote checkpoints: {', '.join(saved)}", saved in (["last.pt"], ["last.prev.pt", "last.pt"])),
        ("only rank 0 wrote TensorBoard events: one file",
         len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 1),
    ], detail=run.output[-2000:])


def check_plain_ddp(single: RunResult, ddp: RunResult, ranks: int) -> None:
    """plain_single.py on one device and plain_ddp.py on ``ranks`` ranks, from the same data."""
    one, many, done = plain_epochs(single.output), plain_epochs(ddp.output), plain_summary(ddp.output)
    verify([
        (f"one device trained: the loss fell from {one[0]:.3f} to {one[-1]:.3f}", one[-1] < one[0]),
        (f"{ranks} ranks trained: the loss fell from {many[0]:.3f} to {many[-1]:.3f}", many[-1] < many[0]),
        (f"each rank took 1/{ranks} of an epoch's batches ({plain_steps(ddp.output)[0]} steps, not "
         f"{plain_steps(single.output)[0]}): the sampler split the data",
         plain_steps(ddp.output)[0] == plain_steps(single.output)[0] // ranks),
        ("only rank 0 printed: one line per epoch", len(many) == len(one)),
        (f"all {ranks} ranks ended with identical weights", done["world_size"] == ranks and done["identical"]),
    ], detail=ddp.output[-2000:])


def check_plain_job(record: dict, log: str, nodes: int, per_node: int) -> None:
    """A Slurm job of plain_ddp.py or plain_resumable.py (slurm/ddp_one_file.sbatch, a TRAIN_SCRIPT through a
    pattern): ``nodes`` x ``per_node`` ranks trained one model."""
    losses, done = plain_epochs(log), plain_summary(log)
    verify([
        (f"the job completed on {record['NodeList']}", record["JobState"] == "COMPLETED"),
        (f"{nodes * per_node} ranks, {per_node} on each of {nodes} nodes, formed one group",
         (done["world_size"], done["per_node"]) == (nodes * per_node, per_node)),
        (f"the loss fell from {losses[0]:.3f} to {losses[-1]:.3f}", len(losses) > 1 and losses[-1] < losses[0]),
        ("every rank ended with identical weights", done["identical"]),
    ], detail=log[-2000:])


def check_requeued_job(record: dict, log: str, ckpt: Path, epochs: int) -> None:
    """slurm/ddp_requeue_one_file.sbatch's job, warned once: it stopped, requeued itself and finished from there."""
    lines = log.splitlines()
    stopped = next((x for x in lines if x.startswith("stopped on SIGUSR1")), "")
    resumed = next((x for x in lines if x.startswith("resumed from")), "")
    where = stopped.split(" in ", 1)[-1].split(";")[0]  # "epoch E, after batch B"
    verify([
        ("Slurm requeued the job once and it completed",
         (record["JobState"], record["Restarts"]) == ("COMPLETED", "1")),
        (f"the first start stopped on the warning, every rank at one step ({where}), with a checkpoint",
         bool(stopped) and str(ckpt.name) in stopped),
        ("the second start resumed from that step", bool(resumed) and resumed.endswith(where)),
        (f"and trained to the end: epoch {epochs - 1}", len(plain_epochs(log)) > 0 and f"epoch {epochs - 1}: " in log),
        ("every rank ended with identical weights", plain_summary(log)["identical"]),
    ], detail=log[-2000:])


def check_restarted_plain(run: RunResult, saved: dict, epochs: int) -> None:
    """plain_resumable.py under torchrun --max-restarts=1, a rank killed after the checkpoint ``saved``."""
    resumed = next((x for x in run.lines if x.startswith("resumed from")), "")
    verify([
        ("torchrun saw a rank die and started the group again", "exitcode: -9" in run.output and bool(resumed)),
        (f"the new ranks went on from the checkpoint, at or after epoch {saved['epoch']}, batch {saved['batch']}",
         lambda: tuple(int(x) for x in resumed.replace(",", "").split()[-4::3]) >= (saved["epoch"], saved["batch"])),
        (f"and trained to the end: epoch {epochs - 1}", f"\nepoch {epochs - 1}: " in run.output),
        ("every rank ended with identical weights", lambda: plain_summary(run.output)["identical"]),
    ], detail=run.output[-2000:])
