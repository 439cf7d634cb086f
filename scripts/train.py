#!/usr/bin/env python
"""The course's one training program.

The same file runs everywhere; only the launcher changes::

    python scripts/train.py --epochs 2                      # laptop, one GPU
    torchrun --standalone --nproc-per-node=4 scripts/train.py   # one node
    srun python scripts/train.py                            # Slurm, a task per GPU

Rank, world size and device come from the launcher's environment
(course_utils.process_group); nothing here is chosen by hand. Every flag is a field of
course_utils.config.TrainConfig, and ``--config run.toml`` sets any of them
(flags given override the file). The last line printed is ``RESULT {json}``
with the final metrics, for notebooks and tests to read.
"""

from __future__ import annotations

import argparse
import dataclasses
import signal
import sys
import time

import torch

from course_utils import process_group as cdist
from course_utils.checkpoint import CheckpointError
from course_utils.config import TrainConfig, add_config_args, config_from_args, in_run_dir
from course_utils.data import DatasetMissingError
from course_utils.devices import PlacementError
from course_utils.errors import fail
from course_utils.hardware import peak_memory_mib
from course_utils.models import count_parameters
from course_utils.results import emit_result
from course_utils.trainer import build_trainer
from course_utils.traces import recording


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = in_run_dir(config_from_args(args))  # in a course Slurm job: its folder (RUN_DIR) by default
        with cdist.session(cfg.device) as (info, device):
            return train(cfg, info, device)
    except (cdist.RendezvousError, PlacementError) as exc:
        return fail(str(exc), code=1)
    except (PermissionError, ValueError, DatasetMissingError, CheckpointError) as exc:
        return fail(str(exc))  # what to change, in one line: no traceback


def train(cfg: TrainConfig, info: cdist.DistEnv, device: torch.device) -> int:
    cdist.print0(cdist.describe(info))
    hosts = cdist.ranks_per_host()
    cdist.print0("ranks per host: " + ", ".join(f"{h} x{n}" for h, n in sorted(hosts.items())))
    cfg = dataclasses.replace(cfg, progress=cfg.progress and sys.stderr.isatty())  # no bars in batch logs
    trainer = build_trainer(cfg, device)  # data, loaders, model (course_utils.trainer)
    n_train = len(trainer.train_loader.dataset)
    if isinstance(trainer.train_loader.dataset, torch.utils.data.IterableDataset):
        n_train *= info.world_size  # shards: the length is this rank's share
    cdist.print0(
        f"{cfg.model}: {count_parameters(trainer.raw_model) / 1e6:.2f} M parameters on {device}; "
        f"{cfg.dataset}: {n_train} train / {len(trainer.val_loader.dataset)} val images; "
        f"global batch {cfg.batch_size * info.world_size * cfg.grad_accum}, lr {trainer.lr:g}"
    )
    # Slurm's warning before the time limit (--signal=USR1@120, or passed on by the batch
    # shell): checkpoint at the next step and stop, so the requeued job loses seconds.
    trainer.stop.install(signal.SIGUSR1)
    start = time.perf_counter()
    with recording(cfg.trace_dir, device, info.rank, skip=cfg.untimed_steps) as profiler:
        trainer.step_callback = profiler.step if profiler else None  # the profiler's schedule counts steps
        history = trainer.fit()
    agree = cdist.ranks_agree(trainer.raw_model)
    cdist.print0(f"all {info.world_size} ranks hold identical parameters: {agree}")
    last = history[-1] if history else None
    emit_result({
        "trainer": "train.py",
        "world_size": info.world_size,
        "hosts": hosts,
        "ranks_agree": agree,
        "device": str(device),
        "lr": trainer.lr,
        "epochs": trainer.epoch,
        "global_step": trainer.global_step,
        "resumed_from": trainer.resumed_from,  # the checkpoint, step and batch this start went on from
        "stopped": trainer.stopped,
        "train_loss": [h.train_loss for h in history],
        "val_loss": last.val_loss if last else None,
        "val_acc": last.val_acc if last else None,
        "images_per_s_per_rank": last.images_per_s if last else None,
        "peak_memory_mib": peak_memory_mib(device),
        "seconds": time.perf_counter() - start,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
