"""One trial: the course's training run (``scripts/train.py``'s data, model and Trainer), reporting to Tune after
each epoch with the checkpoint it has just written; a DDP trial through Ray Train."""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import fields, replace
from typing import Any

import torch

from ..config import TrainConfig

SHAPE_KEYS = ("width", "depth", "norm")  # the architecture knobs of the CNN (models.build_model)
# what run_search adds to a trial's settings: the base TrainConfig, how a DDP trial is laid out, and
# fail_at_epoch: the trial raises after that epoch (a transient failure: not once restored from a checkpoint;
# with fail_every_start, every time: a bug), for notebook 08's lesson on FailureConfig
RUN_KEYS = ("base", "workers", "cpus_per_worker", "gpus_per_worker", "storage", "fail_at_epoch", "fail_every_start")


Report = Callable[[dict[str, Any], str], None]  # (metrics, folder holding the checkpoint)


def trial_settings(params: dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """A trial's :class:`TrainConfig` (the base settings, then the sampled ones) and the CNN's shape."""
    names = {f.name for f in fields(TrainConfig)}
    # a name with a leading underscore is the search's own (a value other values are drawn from); any other
    # name the trial does not read is refused, so that a misspelt one is not silently left out
    unknown = {k for k in params if not k.startswith("_")} - names - set(SHAPE_KEYS) - set(RUN_KEYS)
    if unknown:
        raise ValueError(f"a search space sets TrainConfig fields or {', '.join(SHAPE_KEYS)}, "
                         f"not {', '.join(sorted(unknown))}; name a value that only helps draw others "
                         "with a leading underscore (_base_lr)")
    cfg = TrainConfig(**{**params.get("base", {}), **{k: v for k, v in params.items() if k in names}})
    return cfg, {k: params[k] for k in SHAPE_KEYS if k in params}


def train_one(params: dict[str, Any], device: torch.device, workdir: str, report: Report) -> None:
    """Train the configuration ``params`` with the course's Trainer, resuming from ``workdir/last.pt``
    if a checkpoint was restored there, and ``report`` after every epoch."""
    from ..process_group import ranks_agree
    from ..trainer import build_trainer

    cfg, shape = trial_settings(params)
    cfg = replace(cfg, ckpt_dir=workdir, resume=True, log_dir=None, progress=False)
    trainer = build_trainer(cfg, device, **shape)  # the same set-up as scripts/train.py
    started, host = time.time(), socket.gethostname()
    fresh = trainer.epoch == 0  # not restored from a checkpoint (a resumed search, a retry, PBT's exploit)

    def epoch_done(stats: Any) -> None:
        if trainer.epoch == params.get("fail_at_epoch") and (fresh or params.get("fail_every_start")):
            raise RuntimeError(f"this trial fails on purpose after epoch {trainer.epoch} (fail_at_epoch), "
                               "before reporting it")
        report({"epoch": trainer.epoch, "train_loss": stats.train_loss, "val_loss": stats.val_loss,
                "val_acc": stats.val_acc, "images_per_s": stats.images_per_s, "host": host,
                "lr": trainer.optimizer.param_groups[0]["lr"],  # the one the optimiser used (PBT changes it)
                # a DDP trial's proof: identical replicas (a collective: every worker reports at this point;
                # True without a process group), and each worker's share of the images, not all of them
                "ranks_agree": ranks_agree(trainer.model), "batches": len(trainer.train_loader),
                "device": str(device), "started": started, "now": time.time(),
                # what Ray gave the process: its GPUs' ids, "none" (a trial given no GPU), "unset" (the node's)
                "gpus_seen": os.environ.get("CUDA_VISIBLE_DEVICES", "unset") or "none"}, workdir)

    trainer.epoch_callback = epoch_done
    trainer.fit()


def _use_assigned_cores() -> None:
    """Threads from the CPUs Ray gave this trial, not the node's."""
    import ray

    from ..hardware import usable_cores

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, min(int(cpus), usable_cores())))  # never more than the process may use


def copy_restored(checkpoint: Any, work: str) -> None:
    """Put a restored trial's checkpoint (a resumed search, or a trial restarted after a failure)
    where the Trainer resumes from; nothing for a trial starting afresh."""
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            shutil.copytree(folder, work, dirs_exist_ok=True)


def tune_trial(params: dict[str, Any]) -> None:
    """A Ray Tune function trainable: one process, on the GPU Ray assigned it (if any) or the CPU."""
    from ray import tune

    from ..process_group import choose_device

    _use_assigned_cores()
    with tempfile.TemporaryDirectory(prefix="trial-") as work:
        copy_restored(tune.get_checkpoint(), work)

        def report(metrics: dict[str, Any], folder: str) -> None:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

        # Ray sets CUDA_VISIBLE_DEVICES to the trial's GPUs, empty where it gave none (start_ray's TRIAL_ENV)
        train_one(params, choose_device(trial_settings(params)[0].device), work, report)


def _ddp_worker(params: dict[str, Any]) -> None:
    """One worker of a data-parallel trial: Ray Train has set up its process group (gloo or NCCL)."""
    import ray.train
    import ray.train.torch

    _use_assigned_cores()
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory(prefix="ddp-trial-") as work:
        copy_restored(ray.train.get_checkpoint(), work)

        def report(metrics: dict[str, Any], folder: str) -> None:
            # every worker reports; rank 0 wrote the checkpoint and hands it over
            checkpoint = ray.train.Checkpoint.from_directory(folder) if rank == 0 else None
            ray.train.report({**metrics, "workers": ray.train.get_context().get_world_size()}, checkpoint=checkpoint)

        train_one(params, ray.train.torch.get_device(), work, report)


def ddp_trial(params: dict[str, Any]) -> None:
    """A trial that is itself distributed: ``params["workers"]`` DDP workers started by Ray Train's
    ``TorchTrainer``, whose epochs reach Tune (and ASHA) through ``TuneReportCallback``."""
    import ray.train
    from ray import tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    gpus = float(params.get("gpus_per_worker", 0))
    trainer = TorchTrainer(
        _ddp_worker,
        train_loop_config=params,
        scaling_config=ray.train.ScalingConfig(num_workers=int(params["workers"]), use_gpu=gpus > 0,
                                               resources_per_worker={"CPU": params.get("cpus_per_worker", 1),
                                                                     **({"GPU": gpus} if gpus else {})}),
        run_config=ray.train.RunConfig(name=tune.get_context().get_trial_id(), storage_path=params["storage"],
                                       callbacks=[TuneReportCallback()]),
    )
    trainer.fit()


