#!/usr/bin/env python
"""The course's training run with PyTorch Lightning: the same model, data, optimiser and flags as train.py.

    python scripts/train_lightning.py --epochs 2                     # laptop, one device
    torchrun --standalone --nproc-per-node=2 scripts/train_lightning.py
    srun python scripts/train_lightning.py                           # Slurm: one task per GPU

``--devices`` and ``--num-nodes`` default to what the launcher started; given, they
must match it (checked before Lightning starts, in one line). SIGUSR1 (Slurm's
warning before the time limit) makes every rank stop at the same step after
Lightning writes ``last.ckpt`` in ``--ckpt-dir``; a run started again resumes from
it (slurm/*/multi_node_lightning.sbatch requeues the job). The last line printed
is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time

import torch
from torch.utils.data import Dataset

from course_utils import process_group as cdist
from course_utils.checkpoint import CheckpointError, ensure_writable_dir
from course_utils.config import TrainConfig, add_config_args, config_from_args, in_run_dir, unsupported
from course_utils.data import DatasetInfo, DatasetMissingError, get_datasets
from course_utils.errors import fail
from course_utils.hardware import peak_memory_mib
from course_utils.lit import (
    CourseDataModule,
    CourseModule,
    LaunchPlan,
    STRATEGIES,
    StopOnSignal,
    StopTraining,
    add_launch_args,
    full_weights,
    latest_checkpoint,
    make_trainer,
    plan_launch,
    precision_refused,
    quiet_lightning,
    strategy_refused,
)
from course_utils.models import build_model
from course_utils.precision import resolve_precision
from course_utils.results import emit_result
from course_utils.trainer import evaluate


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    add_launch_args(p)
    p.add_argument("--strategy", choices=STRATEGIES, default="ddp",
                   help="ddp: a whole model per rank; fsdp: parameters, gradients and optimizer state sharded "
                        "(ZeRO-3's layout, FSDP1; CUDA GPUs only); fsdp2: the same with FSDP2's fully_shard "
                        "(ModelParallelStrategy; CPUs too); deepspeed_stage_2: DeepSpeed's ZeRO-2 (CUDA GPUs only). "
                        "Default: ddp")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = in_run_dir(config_from_args(args))  # in a course Slurm job: its folder (RUN_DIR) by default
        cfg = dataclasses.replace(cfg, progress=cfg.progress and sys.stdout.isatty())  # no bars in batch logs
        unsupported(cfg, "train_lightning.py", {"channels_last", "compile", "trace_dir"})
        plan = plan_launch(cfg.device, args.devices, args.num_nodes)
        refused = (strategy_refused(args.strategy, plan)
                   or precision_refused(args.strategy, resolve_precision(cfg.precision, plan.device)))
        if refused:
            raise ValueError(refused)
        for folder, what in ((cfg.ckpt_dir, "checkpoint folder"), (cfg.log_dir, "log folder")):
            if folder:
                ensure_writable_dir(folder, what)
        torch.manual_seed(cfg.seed)  # the same order as train.py: the same data and initial weights
        train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
    except (ValueError, PermissionError, DatasetMissingError) as exc:  # LaunchMismatch is a ValueError
        return fail(str(exc))
    if plan.note:
        cdist.print0(f"note: {plan.note}")
    quiet_lightning()
    code = train(cfg, plan, args.strategy, train_ds, val_ds, meta)
    # DDP keeps the process group alive in reference cycles: free them and leave the group before
    # the interpreter exits, or gloo's threads may be torn down then and abort the process.
    gc.collect()
    cdist.cleanup()
    return code


def train(cfg: TrainConfig, plan: LaunchPlan, strategy: str, train_ds: Dataset, val_ds: Dataset,
          meta: DatasetInfo) -> int:
    model = build_model(cfg.model, meta.channels, meta.num_classes)
    module = CourseModule(model, cfg)
    data = CourseDataModule(train_ds, val_ds, cfg, pin_memory=cfg.pin_memory and plan.accelerator == "gpu")
    trainer = make_trainer(cfg, plan, strategy)
    precision = resolve_precision(cfg.precision, plan.device)  # what make_trainer gave Lightning
    rank0 = cdist.detect_env().rank == 0  # before Lightning joins the ranks: ask the launcher
    start = time.perf_counter()
    try:
        resume = latest_checkpoint(cfg.ckpt_dir, say=lambda line: rank0 and print(line, flush=True)) if cfg.resume else None
        if resume and rank0:
            print(f"resuming from {resume}", flush=True)
        trainer.fit(module, data, ckpt_path=resume)
    except CheckpointError as exc:
        return fail(str(exc))
    except torch.distributed.DistNetworkError as exc:  # Lightning forms the group in fit(): rank 0 listens there
        if not cdist.listen_failure(exc):
            raise
        return fail(cdist.listen_failure(exc))
    except StopTraining as stop:  # Slurm's warning: last.ckpt is written, the batch script requeues
        cdist.print0(f"{stop}; {cfg.ckpt_dir or 'no --ckpt-dir'}/last.ckpt written")
    seconds = time.perf_counter() - start
    # DDP's and DeepSpeed's teardown have moved the model back to the CPU: evaluate, and compare the ranks
    # over Lightning's (NCCL) group, on this rank's device again (strategy.root_device, which plan.device
    # names); FSDP's shards stay on the device and are gathered whole for this (full_weights), with weights and
    # BatchNorm statistics both in fp32 (lit.precision_args: batch norm takes them in one dtype)
    device = trainer.strategy.root_device
    if device != plan.device:  # (the strategy was handed plan.parallel_devices: this would be a course bug)
        raise RuntimeError(f"Lightning placed this rank on {device}, the course's policy on {plan.device}")
    with full_weights(trainer):
        module.model.to(device)
        val_loss, val_acc = evaluate(module.model, data.val_dataloader(), device, precision)
        agree = cdist.ranks_agree(module.model)
    meter = trainer.callbacks[0].meter  # the ThroughputCallback, first in make_trainer's list
    stop_callback = next(c for c in trainer.callbacks if isinstance(c, StopOnSignal))
    emit_result({
        "trainer": "lightning",
        "strategy": strategy,
        "world_size": trainer.world_size,
        "launcher": plan.launcher,
        "hosts": cdist.ranks_per_host(),
        "device": str(device),
        "ranks_agree": agree,
        "epochs": trainer.current_epoch,
        "global_step": trainer.global_step,
        "resumed_from": resume,
        "resumed_at_step": stop_callback.started_at_step if resume else None,
        "stopped": stop_callback.stopped,
        "train_loss": module.epoch_losses,
        "val_loss": val_loss,
        "val_acc": val_acc,
        "images_per_s_per_rank": meter.images_per_s if meter else None,
        "peak_memory_mib": peak_memory_mib(device),
        "seconds": seconds,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
