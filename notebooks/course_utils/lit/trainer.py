"""The ``Trainer(...)`` as the course's scripts make it, the checkpoint a run resumes from, and Lightning's
own output kept to what the lesson reads."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

from ..checkpoint import CheckpointError, load_checkpoint
from ..config import TrainConfig
from ..process_group import collective_timeout_s
from ..precision import resolve_precision, set_tf32
from .launch import LaunchPlan, placement_args, precision_args, sharded_placement
from .module import StopOnSignal, ThroughputCallback


def quiet_lightning() -> None:
    """Silence Lightning's tips that do not apply to the course's runs (the checks above replace them)."""
    import logging
    import warnings

    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # "Initializing distributed: GLOBAL_RANK ..." from every rank: the run's first line says who is who
    logging.getLogger("lightning.fabric.utilities.distributed").setLevel(logging.WARNING)
    tips = ["does not have many workers", "log_every_n_steps", "treespec, LeafSpec", "exists and is not empty",
            "`weights_only` was not set"]
    # "The `srun` command is available on your system but is not used" wherever srun is on the PATH: wrong under
    # torchrun (it started the ranks) and outside a Slurm job (a login node, a notebook's forked ranks); kept inside a
    # job without srun, where it says what plan_launch cannot always see (a plain python in an allocation)
    if "TORCHELASTIC_RUN_ID" in os.environ or "SLURM_JOB_ID" not in os.environ:
        tips.append("The `srun` command is available")
    for tip in tips:
        warnings.filterwarnings("ignore", message=f".*{tip}")


def latest_checkpoint(folder: str | Path | None, say: Callable[[str], None] = print) -> str | None:
    """The newest readable one of ``last.ckpt`` and the checkpoints Lightning writes on Slurm's warning
    signal. An unreadable one (a copy cut short, a full quota) is named (``say``) and passed over for
    the one before it; with none readable, :class:`CheckpointError` names them and what to do."""
    if not folder:
        return None
    if (Path(folder) / "last.ckpt").is_dir():  # --strategy deepspeed_stage_2: DeepSpeed's folder, Lightning reads it
        return str(Path(folder) / "last.ckpt")
    found = [p for p in [Path(folder) / "last.ckpt", *Path(folder).glob("hpc_ckpt_*.ckpt")] if p.is_file()]
    unreadable = []
    for path in sorted(found, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            load_checkpoint(path)  # Lightning would stop in torch.load's traceback
        except CheckpointError as exc:
            unreadable.append(path)
            say(f"warning: {exc}")
            continue
        if unreadable:
            say(f"resuming from the checkpoint before it, {path}")
        return str(path)
    if unreadable:
        raise CheckpointError(f"no readable checkpoint in {folder} ({', '.join(p.name for p in unreadable)} "
                              "unreadable): delete them to start afresh, or give --ckpt-dir a new folder")
    return None


def full_weights(trainer: L.Trainer) -> contextlib.AbstractContextManager:
    """A context in which the LightningModule's parameters are whole on every rank after ``fit``: FSDP's
    are shards outside it (they stay on the rank's device; DDP and DeepSpeed ZeRO-2 keep whole weights)."""
    if isinstance(trainer.strategy, FSDPStrategy):
        from torch.distributed.fsdp import FullyShardedDataParallel

        return FullyShardedDataParallel.summon_full_params(trainer.strategy.model, writeback=False)
    return contextlib.nullcontext()


def make_trainer(config: TrainConfig, plan: LaunchPlan, strategy: str = "ddp") -> L.Trainer:
    """A ``lightning.Trainer`` for ``config``: DDP with the course's timeout (or ``strategy``: FSDP,
    DeepSpeed ZeRO-2, see :func:`strategy_refused`), TensorBoard, checkpoints, requeue."""
    lightning_precision, precision_kwargs = precision_args(strategy, resolve_precision(config.precision, plan.device))
    set_tf32(config.tf32)
    timeout = timedelta(seconds=collective_timeout_s())
    if strategy == "ddp":
        placement = placement_args(plan, DDPStrategy, timeout=timeout, bucket_cap_mb=config.bucket_cap_mb,
                                   gradient_as_bucket_view=config.grad_as_bucket_view)  # DDP only with several ranks
    else:
        placement = sharded_placement(strategy, plan, timeout, **precision_kwargs)
    callbacks: list[L.Callback] = [ThroughputCallback(config.untimed_steps)]
    if config.ckpt_dir:
        # last.ckpt at the end of each epoch, or every N optimiser steps with --ckpt-every-steps (Lightning takes
        # one trigger: then not at epoch ends), from rank 0, replacing the one before. Not
        # save_last=True with save_top_k=0: Lightning 2.6 then writes last.ckpt only when training ends.
        callbacks.append(ModelCheckpoint(dirpath=config.ckpt_dir, filename="last", save_top_k=1,
                                         enable_version_counter=False, every_n_train_steps=config.ckpt_every_steps))
    callbacks.append(StopOnSignal(config.ckpt_dir))
    plugins = []
    if plan.launcher == "slurm":  # Lightning's own requeue off: StopOnSignal and the batch script do it
        plugins.append(SLURMEnvironment(auto_requeue=False))
    return L.Trainer(
        **placement,
        precision=lightning_precision, max_epochs=config.epochs,
        limit_train_batches=config.steps_per_epoch or 1.0, accumulate_grad_batches=config.grad_accum,
        benchmark=config.cudnn_benchmark, log_every_n_steps=config.log_every,
        logger=TensorBoardLogger(config.log_dir, name="", version="") if config.log_dir else False,
        enable_checkpointing=bool(config.ckpt_dir), default_root_dir=config.ckpt_dir or None,
        enable_progress_bar=config.progress, enable_model_summary=False, callbacks=callbacks, plugins=plugins,
    )
