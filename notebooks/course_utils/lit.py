"""The course's model, data and optimiser as Lightning pieces, and the launch checks Lightning leaves to you.

:class:`CourseModule` trains any model of :func:`course_utils.models.build_model` with the
optimiser, learning-rate rule and warm-up of :class:`course_utils.trainer.Trainer`.
:class:`CourseDataModule` serves :func:`course_utils.data.make_loader`'s loaders: they already
give each rank its slice in an order fixed by (seed, epoch), so Lightning keeps their sampler
(it only swaps in a ``DistributedSampler`` for loaders without one) and Lightning, Fabric and
``scripts/train.py`` see the same batches. :func:`plan_launch` reads the launcher's environment
before Lightning starts and stops with one line where Lightning would hang or fail late.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import re
import signal
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.plugins.environments import SLURMEnvironment
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy
from torch import nn
from torch.utils.data import Dataset

from .checkpoint import CheckpointError, load_checkpoint
from .config import TrainConfig, resume_mismatch
from .data import make_loader
from .devices import PlacementError, gpus_bound, node_device
from .process_group import collective_timeout_s
from .precision import resolve_precision, set_tf32
from .preemption import StopRequest
from .timing import Throughput
from .trainer import config_lr, linear_warmup, make_optimizer

# the course's precision names -> Lightning's and Fabric's
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# train_lightning.py --strategy: the same LightningModule replicated (DDP) or sharded (notebook 07's ideas)
STRATEGIES = ("ddp", "fsdp", "deepspeed_stage_2")


class LaunchMismatch(ValueError):
    """The launcher's layout and the Trainer's arguments disagree; the message says what to change."""


class CourseModule(L.LightningModule):
    """A course model, trained with the course's loss, optimiser and warm-up."""

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.model, self.cfg = model, config
        self.save_hyperparameters({"config": dataclasses.asdict(config)})  # in every checkpoint, checked on resume
        self.epoch_losses: list[float] = []  # this rank's mean training loss per epoch
        self._loss_sum, self._steps = 0.0, 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.log("train_loss", loss, prog_bar=True)  # rank 0's value; TensorBoard through the logger
        self._loss_sum += loss.detach()
        self._steps += 1
        return loss  # Lightning calls backward, steps the optimiser and zeroes the gradients

    def on_train_epoch_end(self) -> None:
        self.epoch_losses.append(float(self._loss_sum / max(self._steps, 1)))
        self._loss_sum, self._steps = 0.0, 0
        # a metric, so that it also reaches a notebook's kernel from ddp_notebook's worker processes
        self.log("optimizer_steps", float(self.trainer.global_step), sync_dist=True, reduce_fx="max")

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self.model(x)
        self.log_dict({"val_loss": nn.functional.cross_entropy(logits, y),
                       "val_acc": (logits.argmax(1) == y).float().mean()}, sync_dist=True)

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.model, self.cfg, config_lr(self.cfg, self.trainer.world_size))
        if self.cfg.warmup_epochs <= 0:
            return optimizer
        steps_per_epoch = self.trainer.estimated_stepping_batches / self.cfg.epochs
        steps = max(1, round(self.cfg.warmup_epochs * steps_per_epoch))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": linear_warmup(optimizer, steps),
                                                         "interval": "step"}}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters", {}).get("config", {})
        mismatch = resume_mismatch(saved, self.cfg)
        if mismatch:
            raise CheckpointError(f"the checkpoint was written by another configuration ({'; '.join(mismatch)}): "
                                  "resume with the same settings, or give another --ckpt-dir")


class CourseDataModule(L.LightningDataModule):
    """The course's loaders over data sets already made (the caller seeds and builds them)."""

    def __init__(self, train_ds: Dataset, val_ds: Dataset, config: TrainConfig, pin_memory: bool = False) -> None:
        super().__init__()
        self.train_ds, self.val_ds, self.cfg, self.pin = train_ds, val_ds, config, pin_memory

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return make_loader(self.train_ds, self.cfg.batch_size, shuffle=True, workers=self.cfg.workers,
                           pin_memory=self.pin, persistent_workers=self.cfg.workers > 0, drop_last=True,
                           seed=self.cfg.seed)

    def val_dataloader(self) -> torch.utils.data.DataLoader:
        return make_loader(self.val_ds, 2 * self.cfg.batch_size, shuffle=False, workers=self.cfg.workers,
                           pin_memory=self.pin, seed=self.cfg.seed)


class ThroughputCallback(L.Callback):
    """Images/s per rank over each epoch, with the course's :class:`Throughput` (the same window as ours)."""

    def __init__(self, untimed_steps: int) -> None:
        self.untimed_steps = untimed_steps
        self.meter: Throughput | None = None

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.meter = Throughput(module.device, untimed_steps=self.untimed_steps)
        self.meter.start()

    def on_train_batch_start(self, trainer: L.Trainer, module: L.LightningModule, batch: Any, idx: int) -> None:
        if self.meter is None:  # resumed mid-epoch: Lightning does not start the epoch again
            self.on_train_epoch_start(trainer, module)
        self.meter.data_ready()

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        self.meter.step_done(len(batch[1]))

    def on_train_epoch_end(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.meter.stop()


class OneThreadPerForkedRank(L.Callback):
    """Ranks forked from a notebook kernel (``strategy="ddp_notebook"``) compute with one CPU thread.

    GNU OpenMP, torch's CPU thread pool on Linux, does not survive ``fork``: once the kernel has computed
    with several threads, a forked rank's first multi-threaded operation waits for threads it does not
    have. It hangs here; on a 16-core H200 node a rank died of SIGSEGV. Lightning gives each forked rank
    ``cores // ranks`` threads, one on a 2-core laptop, where this never shows, and 8 on that node. One
    thread is the safe count; ``setup`` runs in each rank before it computes anything.
    """

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        torch.set_num_threads(1)


class StopTraining(Exception):
    """Raised out of ``Trainer.fit`` on every rank at the same step when a stop was asked for."""


class StopOnSignal(L.Callback):
    """Slurm's warning before the time limit, handled as the course's own loop does (notebook 05).

    The signal handler only sets a flag; the ranks agree at a step boundary
    (:class:`course_utils.preemption.StopRequest`), then Lightning writes ``last.ckpt`` and
    training stops; the batch script requeues the job. Lightning's built-in auto-requeue
    (``SLURMEnvironment(auto_requeue=True)``) writes its checkpoint inside the signal handler,
    wherever each rank happens to be, and can hang there (Lightning issue #21406).
    """

    def __init__(self, ckpt_dir: str | None, signum: int = signal.SIGUSR1) -> None:
        self.ckpt_dir, self.signum = ckpt_dir, signum
        self.stop: StopRequest | None = None
        self.stopped = False
        self.started_at_step: int | None = None  # the step fit() began at: a resumed run's restored step

    def setup(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        self.stop = StopRequest()  # after Lightning joined the ranks: it builds a process group of its own
        self.stop.install(self.signum)

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.started_at_step = trainer.global_step  # Lightning has restored its loops from ckpt_path by now

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any, batch: Any,
                           idx: int) -> None:
        if self.stop.poll():  # the same answer on every rank at the same step
            self.stopped = True
            if self.ckpt_dir:  # mid-epoch: a resumed run finishes this epoch's steps
                trainer.save_checkpoint(Path(self.ckpt_dir) / "last.ckpt")
            # Not trainer.should_stop: Lightning would then close the epoch as if it were done (and
            # ModelCheckpoint would overwrite last.ckpt with a finished epoch). Leave fit() here.
            raise StopTraining(f"stopped on request ({self.stop.reason}) after step {trainer.global_step}")

    def teardown(self, trainer: L.Trainer, module: L.LightningModule, stage: str) -> None:
        if self.stop is not None:
            self.stop.close()


@dataclass(frozen=True)
class LaunchPlan:
    """What the Lightning or Fabric launcher gets: the layout of ranks and this rank's device."""

    accelerator: str  # "gpu" or "cpu"
    devices: int  # ranks per node
    num_nodes: int
    launcher: str  # slurm | torchrun | none (Lightning starts the processes itself)
    note: str = ""
    # the device of each local rank, handed to the strategy (parallel_devices) so that Lightning does
    # not count GPUs itself: cuda:0 ... cuda:N-1 when every rank sees the node's GPUs; cuda:0 for each when
    # Slurm binds a GPU to each task (under a launcher Lightning reads this rank's entry only)
    parallel_devices: tuple[str, ...] = ()
    local_rank: int = 0  # this process's: parallel_devices[local_rank] is its device

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def device(self) -> torch.device:
        """This rank's device (Lightning's ``strategy.root_device``), known before Lightning starts."""
        return torch.device(self.parallel_devices[self.local_rank] if self.parallel_devices else "cpu")


def _slurm_int(value: str) -> int:
    return int(re.match(r"\d+", value).group())  # "2(x2)" -> 2: Slurm's compressed per-node counts


def plan_launch(device: str, devices: int | None, num_nodes: int | None, gpus_visible: int | None = None,
                env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check ``--devices``/``--num-nodes`` against the launcher and place this rank, before Lightning starts.

    Lightning checks ``devices``/``num_nodes`` against Slurm's or torchrun's layout itself, when
    ``fit()`` starts its launcher (after the data and the model are built); this makes the same
    check first, with the fix in the same line. It adds what Lightning cannot see: a plain
    ``python`` in a multi-task batch script leaves Lightning waiting for ranks that never start,
    and Lightning puts local rank r on GPU r, which under Slurm's GPU binding (``--gpus-per-task``,
    ``--gpu-bind``) is a GPU the task cannot see. Each mistake is one
    :class:`LaunchMismatch` here, and the device comes from the course's one policy
    (:func:`course_utils.devices.node_device`), handed to Lightning as the strategy's
    ``parallel_devices``. ``gpus_visible`` and ``env`` are this process's facts (read when not given).
    """
    env = os.environ if env is None else env
    if gpus_visible is None:
        gpus_visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = gpus_visible
    local_rank = 0
    # Lightning reads Slurm's variables itself (its SLURMEnvironment: whenever SLURM_NTASKS is set outside an
    # interactive job and torchrun did not start the process, even behind slurm/lib/torch_env.sh), so these checks
    # follow what Lightning will do, not the course's translation (torch_env.sh, process_group.detect_env).
    # Lightning asks torchrun first (TORCHELASTIC_RUN_ID): torchrun inside a Slurm job (a notebook's run_script in a
    # JupyterLab job, idev) is torchrun's layout, not the job's tasks.
    torchrun = "TORCHELASTIC_RUN_ID" in env
    if not torchrun and "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        launcher = "slurm"
        if _slurm_int(env["SLURM_NTASKS"]) > 1 and "SLURM_STEP_NUM_TASKS" not in env:
            raise LaunchMismatch("this job has several tasks but the script was not started by srun, so Lightning "
                                 "would wait for ranks that never start: run it as `srun python scripts/...`")
        if "SLURM_NTASKS_PER_NODE" not in env and _slurm_int(env["SLURM_NTASKS"]) > 1:
            raise LaunchMismatch("Lightning needs the tasks per node: request --ntasks-per-node=N (with --nodes), "
                                 "not --ntasks")
        per_node, nodes = _slurm_int(env.get("SLURM_NTASKS_PER_NODE", "1")), _slurm_int(env.get("SLURM_NNODES", "1"))
        local_rank = int(env.get("SLURM_LOCALID", "0") or 0)
        where = f"the job runs --ntasks-per-node={per_node} on --nodes={nodes}"
    elif "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        per_node = int(env["LOCAL_WORLD_SIZE"])
        nodes = max(1, int(env["WORLD_SIZE"]) // per_node)
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        where = f"torchrun started {per_node} process(es) per node on {nodes} node(s)"
    else:  # Lightning starts the ranks: LOCAL_RANK is unset in the first, set in those it starts
        launcher, per_node, nodes, where = "none", devices or 1, num_nodes or 1, ""
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    if devices is not None and devices != per_node:
        raise LaunchMismatch(f"--devices {devices} but {where}: pass --devices {per_node}, or leave it out "
                             "(the script reads it from the launcher)")
    if num_nodes is not None and num_nodes != nodes:
        raise LaunchMismatch(f"--num-nodes {num_nodes} but {where}: pass --num-nodes {nodes}, or leave it out")

    bound = launcher == "slurm" and gpus_bound(env)
    try:
        mine = node_device(device, per_node, gpus, local_rank, bound)
    except (PlacementError, ValueError) as exc:
        raise LaunchMismatch(str(exc)) from exc
    if mine == "cpu":
        note = "" if gpus == 0 or device == "cpu" else (
            f"{per_node} ranks per node but only {gpus} GPU(s): every rank runs on the CPU with gloo "
            "(NCCL never puts two ranks on one GPU)")
        return LaunchPlan("cpu", per_node, nodes, launcher, note, ("cpu",) * per_node, local_rank)
    if launcher == "none" or mine == f"cuda:{local_rank}" and not bound:
        # every rank sees the node's GPUs: rank r takes GPU r (and Lightning's DeepSpeed checks exactly that)
        placed = tuple(f"cuda:{r}" for r in range(per_node))
    else:  # bound: each task's own GPU is its cuda:0; only this rank's entry is read (root_device)
        placed = (mine,) * per_node
    return LaunchPlan("gpu", per_node, nodes, launcher, "", placed, local_rank)


def placement_args(plan: LaunchPlan, ddp_strategy: type, **strategy_kwargs: Any) -> dict[str, Any]:
    """``accelerator``, ``devices``, ``num_nodes`` and ``strategy`` for a Lightning ``Trainer`` or a ``Fabric``
    (``ddp_strategy``: the ``DDPStrategy`` class of either). Several ranks get their devices from the plan as
    the strategy's ``parallel_devices`` (a device count would be checked against the visible GPUs, and
    Lightning would put rank r on GPU r); one process gets its GPU's index, or one CPU."""
    if plan.world_size > 1:
        strategy = ddp_strategy(parallel_devices=[torch.device(d) for d in plan.parallel_devices], **strategy_kwargs)
        return {"accelerator": plan.accelerator, "devices": "auto", "num_nodes": plan.num_nodes, "strategy": strategy}
    devices = [plan.device.index] if plan.device.type == "cuda" else 1
    return {"accelerator": plan.accelerator, "devices": devices, "num_nodes": plan.num_nodes, "strategy": "auto"}


def quiet_lightning() -> None:
    """Silence Lightning's tips that do not apply to the course's runs (the checks above replace them)."""
    import logging
    import warnings

    logging.getLogger("lightning.pytorch.utilities.rank_zero").setLevel(logging.WARNING)
    # Not "The `srun` command is available on your system but is not used": under Slurm without srun it
    # says what plan_launch cannot always see (a notebook or torchrun inside an allocation)
    tips = ("does not have many workers", "log_every_n_steps", "treespec, LeafSpec", "exists and is not empty",
            "`weights_only` was not set")
    for tip in tips:
        warnings.filterwarnings("ignore", message=f".*{tip}")


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``--devices`` and ``--num-nodes`` for the Lightning and Fabric scripts (checked by :func:`plan_launch`)."""
    parser.add_argument("--devices", type=int, help="ranks per node (default: what the launcher started)")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: what the launcher started)")


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


def strategy_refused(strategy: str, plan: LaunchPlan) -> str | None:
    """Why ``strategy`` cannot run with ``plan`` (one line that says what to do instead), or None.

    Lightning 2.6 runs both sharded strategies on CUDA GPUs only: the Trainer refuses ``fsdp`` with
    another accelerator, and ``DeepSpeedStrategy.setup_environment`` refuses it once ``fit`` starts,
    after the data and model are built. The course's own scripts shard on CPUs too (notebook 07)."""
    if strategy not in STRATEGIES:
        return f"--strategy {strategy}: choose one of {', '.join(STRATEGIES)}"
    if strategy != "ddp" and plan.accelerator != "gpu":
        instead = "train_fsdp.py (FSDP2)" if strategy == "fsdp" else "train_deepspeed.py"
        return (f"--strategy {strategy}: Lightning runs it on CUDA GPUs only, and this run is on {plan.device}; "
                f"scripts/{instead} shards the same model on CPUs too (notebook 07)")
    indices = [torch.device(d).index for d in plan.parallel_devices]
    if strategy.startswith("deepspeed") and indices != list(range(len(indices))):
        # DeepSpeedStrategy.setup_distributed refuses it in fit(), after the data and the model are built
        return (f"--strategy {strategy}: Lightning's DeepSpeed wants local rank r on GPU r of the GPUs every rank "
                f"sees, and this node's ranks are on {', '.join(plan.parallel_devices)} (Slurm binds a GPU to each "
                "task, or --device names one): submit without GPU binding (no --gpus-per-task, no COURSE_GPU_BIND), "
                "or use --strategy ddp or fsdp")
    return None


def precision_args(strategy: str, precision: str) -> tuple[str, dict[str, Any]]:
    """Lightning's ``precision=`` and what ``strategy`` is given for it, from the course's resolved ``precision``
    (fp32, bf16 or fp16: :func:`course_utils.precision.resolve_precision` decides it from the hardware).

    FSDP keeps the weights and the buffers (BatchNorm's running statistics) in fp32 whatever the precision;
    autocast, from Lightning's precision plugin, does the bf16/fp16 math, as under DDP. Left to Lightning 2.6,
    "16-mixed" and "bf16-mixed" cast the parameters *and the buffers* to fp16/bf16
    (``FSDPPrecision.mixed_precision_config``), and ``summon_full_params`` restores only the parameters to
    fp32: the evaluation after ``fit`` met batch norm with fp16 statistics and fp32 weights, a type error.
    Buffers alone in fp32 will not do: batch norm takes its weights and statistics in one dtype. The price:
    FSDP gathers and reduces fp32 (twice fp16's bytes), as DDP all-reduces fp32 gradients under autocast.
    """
    if precision not in LIGHTNING_PRECISION:
        raise ValueError(f"precision {precision!r}: resolve it first (one of {', '.join(LIGHTNING_PRECISION)})")
    if strategy != "fsdp":
        return LIGHTNING_PRECISION[precision], {}
    from torch.distributed.fsdp import MixedPrecision

    fp32 = torch.float32
    return LIGHTNING_PRECISION[precision], {
        "mixed_precision": MixedPrecision(param_dtype=fp32, reduce_dtype=fp32, buffer_dtype=fp32)}


def sharded_placement(strategy: str, plan: LaunchPlan, timeout: timedelta, **strategy_kwargs: Any) -> dict[str, Any]:
    """``placement_args`` for FSDP or DeepSpeed ZeRO-2: the strategy gets the plan's devices, also for one process
    (and ``strategy_kwargs``: :func:`precision_args`'s)."""
    devices = [torch.device(d) for d in plan.parallel_devices] or [plan.device]
    if strategy == "fsdp":  # FULL_SHARD: ZeRO-3's layout
        made = FSDPStrategy(parallel_devices=devices, timeout=timeout, **strategy_kwargs)
    else:
        made = DeepSpeedStrategy(stage=2, parallel_devices=devices, timeout=timeout, **strategy_kwargs)
    return {"accelerator": plan.accelerator, "devices": "auto", "num_nodes": plan.num_nodes, "strategy": made}


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
