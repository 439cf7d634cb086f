"""Notebooks 06 and 08: four trainers at one loss, Lightning's jobs, ASHA against FIFO (07's are in :mod:`.sharding`)."""

from __future__ import annotations

import math
from typing import Any
from pathlib import Path

from ..claims import verify


def check_plain_fabric(ddp: Any, fabric: Any, ranks: int, exact: bool) -> None:
    """06 section 5: plain_ddp.py and plain_fabric.py on ``ranks`` ranks, the same data and seed (their runs'
    output). ``exact``: on CPUs, where both compute in fp32 in one order, the printed losses must be the same."""
    from ..results import plain_epochs, plain_steps, plain_summary

    by_hand, by_fabric = plain_epochs(ddp.output), plain_epochs(fabric.output)
    done = plain_summary(fabric.output)
    same = by_hand == by_fabric if exact else len(by_hand) == len(by_fabric) and all(
        abs(a - b) <= 0.02 * abs(a) for a, b in zip(by_hand, by_fabric))
    verify([
        (f"plain_fabric.py trained: the loss fell from {by_fabric[0]:.4f} to {by_fabric[-1]:.4f}",
         len(by_fabric) > 1 and by_fabric[-1] < by_fabric[0]),
        ("with plain_ddp.py's steps and " + ("its losses, to the printed digit" if exact else
                                             "its losses within 2% (mixed precision on GPUs)"),
         same and plain_steps(ddp.output) == plain_steps(fabric.output)),
        (f"and its {ranks} ranks ended with identical weights", done["world_size"] == ranks and done["identical"]),
    ], detail=lambda: f"plain_ddp.py {by_hand}, plain_fabric.py {by_fabric}")


def check_four_trainers(rows: dict[str, dict], world: int) -> None:
    """06: the course Trainer, the loop by hand, Lightning and Fabric, on one seed, data order and arithmetic."""
    base = rows["course Trainer"]
    apart = {name: r["val_loss"] for name, r in rows.items() if r["val_loss"] != base["val_loss"]}
    verify([
        (f"every trainer ran {world} ranks whose weights agree",
         all(r["ranks_agree"] and r["world_size"] == world for r in rows.values())),
        ("each took as many optimiser steps as the others, and its training loss fell",
         all(r["global_step"] == base["global_step"] and r["train_loss"][-1] < r["train_loss"][0]
             for r in rows.values())),
        (f"all four ended at one validation loss, bit for bit: {base['val_loss']!r}", not apart),
        ("Fabric's second run went on from the first's checkpoint, written after epoch 1",
         rows["Fabric"]["resumed_from"]["epoch"] == 1),
    ], detail=lambda: f"validation losses apart from the course Trainer's: {apart}")


def check_lightning_jobs(bad: dict, per_node: int, good: dict, epochs: int, steps_per_epoch: int) -> None:
    """06: multi_node_lightning.sbatch twice. ``bad``: the job with --devices 1 (its record, log and error lines);
    ``good``: the job warned, requeued and resumed (its record, each start's result, the checkpoint's path)."""
    record, first, final = good["record"], good["first"], good["final"]
    stopped_at = first["global_step"]
    verify([
        (f"the job with --devices 1 stopped before training, in one line naming the fix (pass --devices {per_node})",
         bad["record"]["JobState"] == "FAILED" and len(bad["errors"]) == 1
         and f"pass --devices {per_node}" in bad["errors"][0]),
        ("with no traceback and no training", 'train_lightning.py", line' not in bad["log"]
         and "RESULT" not in bad["log"]),
        ("Slurm requeued the other job once and it completed", record["JobState"] == "COMPLETED"
         and record["Restarts"] == "1"),
        (f"its first start began afresh and stopped on the warning, at step {stopped_at}, before the last "
         f"({epochs * steps_per_epoch})", first["stopped"] and first["resumed_from"] is None
         and stopped_at < epochs * steps_per_epoch),
        (f"the second start resumed from {Path(good['ckpt']).name}, at the step the first stopped at",
         final["resumed_from"] == str(good["ckpt"]) and not final["stopped"] and final["resumed_at_step"] == stopped_at),
        (f"and trained every step once: {final['global_step']} steps, {final['epochs']} epochs",
         final["global_step"] == epochs * steps_per_epoch and final["epochs"] == epochs),
    ])


def check_asha_against_fifo(asha_rows: list[dict], fifo_rows: list[dict], asha: dict, fifo: dict,
                            bad: tuple[float, float], on_gpu: bool) -> None:
    """08: the same draws searched with ASHA and run to the end (FIFO), and a deliberately bad configuration, all
    scored on the same held-out images. ``*_rows``: tuning.trials; ``asha``, ``fifo``: their summaries."""
    to_the_end = {str(r["config"]): r["val_loss"] for r in fifo_rows}
    same = 2e-2 if on_gpu else 1e-6  # bit for bit on a CPU, within a GPU's nondeterministic kernels
    wrongly_stopped = [r for r in asha_rows if r["status"] == "stopped early" and not any(
        o["epochs"] > r["epochs"] and o["val_loss"][r["epochs"] - 1] <= r["val_loss"][r["epochs"] - 1]
        for o in asha_rows)]
    bad_loss, bad_acc = bad
    verify([
        ("no trial of either search errored", asha["errored"] == fifo["errored"] == 0),
        ("ASHA cut trials short and changed nothing else: each trained as the same draw did when run to the end",
         all(all(math.isclose(a, b, rel_tol=same) for a, b in zip(r["val_loss"], to_the_end[str(r["config"])]))
             for r in asha_rows)),
        (f"ASHA stopped {asha['stopped_early']} trial(s) early and spent {asha['epochs']} of FIFO's {fifo['epochs']} "
         "epochs", asha["stopped_early"] >= 1 and asha["epochs"] < fifo["epochs"]),
        ("the trial best after its first epoch went on past the first rung",
         min(asha_rows, key=lambda r: r["val_loss"][0])["epochs"] > 1),
        ("each trial ASHA stopped at a rung was behind, there, a trial that went on", not wrongly_stopped),
        (f"the search found a better model than a bad configuration, on held-out images: accuracy "
         f"{fifo['held_out_acc']:.3f} against {bad_acc:.3f}",
         fifo["held_out_loss"] < bad_loss and fifo["held_out_acc"] > bad_acc + 0.05),
    ], detail=lambda: f"stopped although no trial that went on was ahead: {[r['config'] for r in wrongly_stopped]}")
