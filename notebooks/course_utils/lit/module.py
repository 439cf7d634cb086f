"""The course's model, data and optimiser as Lightning pieces, and the callbacks its scripts add: throughput,
one thread per forked rank, a stop on Slurm's warning signal."""

from __future__ import annotations

import dataclasses
import signal
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torchmetrics
from torch import nn
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.utils.data import Dataset

from ..checkpoint import CheckpointError
from ..config import TrainConfig, resume_mismatch
from ..data import make_loader
from ..preemption import StopRequest
from ..rng import rng_state_json, set_rng_state_json
from ..sharding import shard_units
from ..timing import Throughput
from ..trainer import config_lr, linear_warmup, make_optimizer


class CourseModule(L.LightningModule):
    """A course model, trained with the course's loss, optimiser and warm-up."""

    def __init__(self, model: nn.Module, config: TrainConfig) -> None:
        super().__init__()
        self.model, self.cfg = model, config
        self.save_hyperparameters({"config": dataclasses.asdict(config)})  # in every checkpoint, checked on resume
        self.epoch_losses: list[float] = []  # this rank's mean training loss per epoch
        self._loss_sum, self._steps = 0.0, 0
        # the validation epoch's means over every image of every rank (torchmetrics sums them across the ranks),
        # not a mean of batch means
        self.val_loss, self.val_acc = torchmetrics.MeanMetric(), torchmetrics.MeanMetric()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x)

    def configure_model(self) -> None:
        """Under ``ModelParallelStrategy`` (``--strategy fsdp2``) only, which gives the module its device mesh:
        FSDP2's ``fully_shard``, each block of the model and then the whole, as ``train_fsdp.py`` does. Every
        other strategy wraps the model itself, and Lightning calls this hook for all of them."""
        if self.device_mesh is None or isinstance(self.model, FSDPModule):  # not FSDP2, or sharded already
            return
        mesh = self.device_mesh["data_parallel"]
        for unit in shard_units(self.model):
            fully_shard(unit, mesh=mesh)
        fully_shard(self.model, mesh=mesh)

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
        self.val_loss.update(nn.functional.cross_entropy(logits, y, reduction="none"))
        self.val_acc.update((logits.argmax(1) == y).float())
        self.log_dict({"val_loss": self.val_loss, "val_acc": self.val_acc})  # computed and reset each epoch

    def configure_optimizers(self) -> Any:
        optimizer = make_optimizer(self.model, self.cfg, config_lr(self.cfg, self.trainer.world_size))
        if self.cfg.warmup_epochs <= 0:
            return optimizer
        steps_per_epoch = self.trainer.estimated_stepping_batches / self.cfg.epochs
        steps = max(1, round(self.cfg.warmup_epochs * steps_per_epoch))
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": linear_warmup(optimizer, steps),
                                                         "interval": "step"}}

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Lightning keeps no random state: the augmentation's streams, as the course's Trainer saves them (rank
        # 0's, every rank's: they all seed alike and draw alike), so a resumed run draws what it would have
        checkpoint["course_rng"] = rng_state_json()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        saved = checkpoint.get("hyper_parameters", {}).get("config", {})
        mismatch = resume_mismatch(saved, self.cfg)
        if mismatch:
            raise CheckpointError(f"the checkpoint was written by another configuration ({'; '.join(mismatch)}): "
                                  "resume with the same settings, or give another --ckpt-dir")
        if "course_rng" in checkpoint:
            set_rng_state_json(checkpoint["course_rng"])


class CourseDataModule(L.LightningDataModule):
    """The course's loaders over data sets already made (the caller seeds and builds them)."""

    def __init__(self, train_ds: Dataset, val_ds: Dataset, config: TrainConfig, pin_memory: bool = False) -> None:
        super().__init__()
        self.train_ds, self.val_ds, self.cfg, self.pin = train_ds, val_ds, config, pin_memory

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        # stateful: Lightning saves where the epoch is in last.ckpt, and a resumed run goes on from there
        return make_loader(self.train_ds, self.cfg.batch_size, shuffle=True, workers=self.cfg.workers,
                           pin_memory=self.pin, persistent_workers=self.cfg.workers > 0, drop_last=True,
                           seed=self.cfg.seed, stateful=True)

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
