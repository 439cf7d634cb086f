"""Notebooks 04-05: jobs on the practice cluster, a collective that times out, submitit, and every stop and resume."""

from __future__ import annotations

import re
from pathlib import Path

import torch

from ..claims import verify
from ..launch import RunResult
from ..results import plain_epochs, plain_steps, plain_summary


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


def check_collective_timeout(run: RunResult, label: str) -> None:
    """04: collective_timeout.py on 2 ranks, a 5 s collective timeout, one rank that never joins."""
    verify([
        (f"a rank that never joins a collective fails the job ({label}: exit code {run.returncode})", run.returncode != 0),
        ("rank 0's collective raised at the timeout", "rank 0: the all_reduce failed after" in run.output),
        ("and did not return as if it had worked", "returned, which it must not" not in run.output),
        (f"the 5 s collective timeout ended the job after {run.seconds:.0f} s, not the launcher's 120 s limit",
         run.seconds < 60),
    ], detail=run.output[-2000:])


def check_submitit_ranks(ranks: list[dict], nodes: int | None) -> None:
    """04: what submitit's job returned from every task; ``nodes`` where it ran under Slurm."""
    world = ranks[0]["world"]
    verify([
        (f"the tasks were ranks 0 to {world - 1}, and every one all-reduced their sum, {world * (world - 1) // 2}",
         [r["rank"] for r in ranks] == list(range(world)) and all(r["sum"] == world * (world - 1) / 2 for r in ranks)),
        (f"every task met at one address, {ranks[0]['rendezvous']}", len({r["rendezvous"] for r in ranks}) == 1),
        *([(f"the tasks ran on all {nodes} nodes of the job", len({r["host"] for r in ranks}) == nodes)] if nodes else []),
    ])


def _same_step(stopped: str, resumed: str, steps: list[int]) -> bool:
    """Whether "resumed from ...: epoch E, after batch B" is the step "epoch E, after batch B" stopped at: the last
    batch of an epoch is saved as the start of the next (epoch E + 1, after batch 0)."""
    def step(text: str) -> tuple[int, int] | None:
        found = re.search(r"epoch (\d+), after batch (\d+)", text)
        return (int(found[1]), int(found[2])) if found else None

    (e, b), again = step(stopped) or (-1, -1), step(resumed)
    return again is not None and (again == (e, b) or again == (e + 1, 0) and b in steps)


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
        ("the second start resumed from that step", _same_step(where, resumed, plain_steps(log))),
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


def check_killed_and_resumed(output: str, saved: dict, reference: dict, restarted: dict, device: str) -> None:
    """train.py's run with a rank killed after the mid-epoch checkpoint ``saved``, against the undisturbed run."""
    verify([
        ("the restarted group resumed in the middle of the epoch", "resumed from" in output and "(after batch " in output),
        (f"the checkpoint it resumed from was a step checkpoint ({saved['in_epoch']['batches']} batches, a multiple "
         "of 5), and both runs ended at the same epoch",
         saved["in_epoch"]["batches"] % 5 == 0 and restarted["epoch"] == reference["epoch"]),
        (f"its final state (weights and BatchNorm's statistics) is bit for bit the undisturbed run's, on {device}",
         all(torch.equal(reference["model"][k], restarted["model"][k]) for k in reference["model"])),
        ("and so is every epoch's loss",
         [h["train_loss"] for h in reference["history"]] == [h["train_loss"] for h in restarted["history"]]),
    ])


def check_elastic(worlds: list[str], output: str, final_epoch: int, epochs: int) -> None:
    """The surviving elastic node's run: the world sizes its workers saw, and its last checkpoint's epoch."""
    verify([
        (f"the job started with 2 nodes and finished with 1 (rank/world seen: {', '.join(worlds)})",
         worlds[0] == "0/2" and worlds[-1] == "0/1"),
        (f"the survivor resumed from the checkpoint and finished all {epochs} epochs",
         "resumed from" in output and final_epoch == epochs),
    ])


def check_requeued_train(record: dict, first: dict, final: dict, ckpt: Path, epochs: int) -> None:
    """slurm/<site>/requeue.sbatch's job of train.py, warned once: what each start reported (its RESULT line)."""
    verify([
        ("Slurm requeued the job once and it completed",
         (record["JobState"], record["Restarts"]) == ("COMPLETED", "1")),
        (f"the first start began afresh and stopped on the warning, after step {first['global_step']}",
         first["stopped"] and first["resumed_from"] is None),
        ("the second start went on from the checkpoint the first wrote when it stopped",
         lambda: Path(final["resumed_from"]["path"]) == ckpt and final["resumed_from"]["step"] == first["global_step"]),
        (f"mid-epoch, after batch {final['resumed_from']['batch'] if final['resumed_from'] else '?'} of its epoch: no "
         "batch was trained twice", lambda: bool(final["resumed_from"]["batch"])),
        (f"and it finished the run's {epochs} epochs", not final["stopped"] and final["epochs"] == epochs),
    ])
