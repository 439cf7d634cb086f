"""A small Trainer, in the spirit of pytorch/examples' ddp-tutorial-series.

The same object trains on a CPU, one GPU, or as one rank of many: when a
process group exists it wraps the model in DistributedDataParallel, skips
the gradient all-reduce on accumulation micro-steps (``no_sync``), and only
rank 0 writes logs and checkpoints. Each speed-up from notebook 01 is one
switch in :class:`TrainConfig`.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

from . import process_group as cdist
from .checkpoint import CheckpointError, ensure_writable_dir, load_latest, save_checkpoint
from .config import TrainConfig, resume_mismatch
from .data import get_datasets, make_loader, set_epoch
from .errors import first_line
from .models import build_model
from .precision import autocast, resolve_precision, set_math_switches
from .preemption import StopRequest
from .rng import rng_state, set_rng_state
from .timing import Throughput

__all__ = ["EpochStats", "TrainConfig", "Trainer", "build_trainer", "config_lr", "evaluate", "history_table",
           "build_optimizer", "groups_by_tensor_kind", "linear_warmup", "make_optimizer", "scaled_lr"]

def linear_warmup(optimizer: torch.optim.Optimizer, steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """Ramp the learning rate from lr/steps to lr over ``steps`` optimiser steps, then hold it.

    With the linear scaling rule (lr grows with the global batch), the first
    steps at full rate can diverge; a short warm-up avoids that.
    """
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / steps))


def scaled_lr(base_lr: float, world_size: int, grad_accum: int = 1) -> float:
    """Linear scaling rule: the global batch grew by world_size x grad_accum, so does the lr."""
    return base_lr * world_size * grad_accum


def config_lr(cfg: TrainConfig, world_size: int) -> float:
    """The learning rate a run uses: ``cfg.lr``, or scaled by the global batch with ``scale_lr``."""
    return scaled_lr(cfg.lr, world_size, cfg.grad_accum) if cfg.scale_lr else cfg.lr


def groups_by_tensor_kind(params: Iterable[torch.Tensor]) -> list[dict]:
    """The parameters as one group per kind of tensor, plain or DTensor (tensor parallel, FSDP2).

    A model split by DTensor keeps some plain parameters (a LayerNorm no plan names), and the foreach
    kernels refuse a list that mixes the two ("got mixed torch.Tensor and DTensor"); an optimiser steps
    one group at a time, so each group's list is of one kind."""
    from torch.distributed.tensor import DTensor

    plain, dtensors = [], []
    for p in params:
        (dtensors if isinstance(p, DTensor) else plain).append(p)
    return [{"params": group} for group in (plain, dtensors) if group]


def build_optimizer(params: Iterable[torch.Tensor], name: str, lr: float, momentum: float = 0.0,
                    weight_decay: float = 0.0) -> torch.optim.Optimizer:
    """SGD or AdamW on the implementation CUDA gives them by default (foreach), on every device.

    torch picks foreach on CUDA and the per-tensor loop on CPUs; asking for foreach everywhere makes a
    CPU run take the path a GPU will, so a failure of that path shows up here, not on a workshop's GPUs."""
    groups = groups_by_tensor_kind(params)
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=momentum, weight_decay=weight_decay, foreach=True)
    raise ValueError(f"optimizer is sgd or adamw, not {name!r}")


def make_optimizer(model: nn.Module, cfg: TrainConfig, lr: float) -> torch.optim.Optimizer:
    """The course's optimiser, the same in every trainer (ours, Lightning's, Fabric's, DeepSpeed's, FSDP's)."""
    return build_optimizer(model.parameters(), cfg.optimizer, lr, cfg.momentum, cfg.weight_decay)


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device, precision: str = "fp32",
             memory_format: torch.memory_format = torch.contiguous_format) -> tuple[float, float]:
    """Mean loss and accuracy over ``loader``, summed over all ranks: one yardstick for every trainer."""
    was_training = model.training
    model.eval()
    sums = torch.zeros(3, device=device, dtype=torch.float64)  # loss, correct, n
    for x, y in loader:
        x = x.to(device, non_blocking=True, memory_format=memory_format)
        y = y.to(device, non_blocking=True)
        with autocast(precision, device):
            logits = model(x)
        sums[0] += nn.functional.cross_entropy(logits.float(), y, reduction="sum")
        sums[1] += (logits.argmax(1) == y).sum()
        sums[2] += y.numel()
    if cdist.get_world_size() > 1:
        torch.distributed.all_reduce(sums)
    model.train(was_training)
    n = max(sums[2].item(), 1)
    return sums[0].item() / n, sums[1].item() / n


LINE_EVERY_S = 60.0  # how often a run without a progress bar (a Slurm log) prints where it is


@dataclass
class EpochStats:
    epoch: int
    train_loss: float
    val_loss: float = float("nan")
    val_acc: float = float("nan")
    images_per_s: float = float("nan")
    data_fraction: float = float("nan")


class Trainer:
    """Train ``model`` on ``train_loader``; ``fit()`` returns the per-epoch history."""

    def __init__(
        self,
        model: nn.Module,
        train_loader: DataLoader,
        device: torch.device | str,
        config: TrainConfig | None = None,
        val_loader: DataLoader | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        scheduler: Any | None = None,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        self.cfg = config or TrainConfig()
        if self.cfg.grad_accum < 1:
            raise ValueError("grad_accum must be >= 1")
        self.device = torch.device(device)
        self.precision = resolve_precision(self.cfg.precision, self.device)
        # Fail now, not after the first epoch, if logs or checkpoints cannot be written: on every rank, before
        # the model is wrapped (a rank that went on alone would wait in DDP's first broadcast until the timeout).
        for d, what in ((self.cfg.log_dir, "log folder"), (self.cfg.ckpt_dir, "checkpoint folder")):
            if d:
                ensure_writable_dir(d, what)
        set_math_switches(self.cfg.tf32, self.cfg.cudnn_benchmark)

        self.memory_format = torch.channels_last if self.cfg.channels_last else torch.contiguous_format
        self.raw_model = model.to(self.device, memory_format=self.memory_format)
        self.model = self._wrap(self.raw_model)

        self.train_loader, self.val_loader = train_loader, val_loader
        self.lr = config_lr(self.cfg, cdist.get_world_size())
        self.optimizer = optimizer or make_optimizer(self.raw_model, self.cfg, self.lr)
        if scheduler is None and self.cfg.warmup_epochs > 0:
            scheduler = linear_warmup(self.optimizer, self._lr_warmup_steps())
        self.scheduler = scheduler
        self.loss_fn = loss_fn or nn.CrossEntropyLoss()
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.precision == "fp16")
        self.epoch = 0
        self.global_step = 0
        self.history: list[EpochStats] = []
        self.step_losses: list[float] = []
        self._last_line = time.monotonic()  # without a progress bar (a batch log): a line every LINE_EVERY_S
        self.step_callback: Callable[[], None] | None = None  # e.g. a profiler's step()
        # after each epoch, its checkpoint written: e.g. Ray Tune's report (course_utils.tuning)
        self.epoch_callback: Callable[[EpochStats], None] | None = None
        self.stop = StopRequest()  # train.py installs it on SIGUSR1: Slurm's warning before the time limit
        self.stopped = False  # fit() ended early on a stop request
        self.epoch_complete = True
        self._resume_in_epoch: dict[str, Any] | None = None  # from a mid-epoch checkpoint
        # where this run resumed: the checkpoint, at which step, after which batch of its epoch (None: it started afresh)
        self.resumed_from: dict[str, Any] | None = None
        self.writer = None
        if self.cfg.log_dir and cdist.is_main_process():
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(self.cfg.log_dir)
        if self.cfg.ckpt_dir and self.cfg.resume:
            self.resume_from(self.ckpt_path)

    # ------------------------------------------------------------------ #
    def _wrap(self, net: nn.Module) -> nn.Module:
        """DDP when there are several ranks (it all-reduces the gradients), then torch.compile if asked."""
        self.ddp = None
        if cdist.get_world_size() > 1:
            ids = [self.device.index] if self.device.type == "cuda" else None
            net = self.ddp = DDP(net, device_ids=ids, bucket_cap_mb=self.cfg.bucket_cap_mb,
                                 gradient_as_bucket_view=self.cfg.grad_as_bucket_view)
        self._buckets_settled = self.ddp is None
        return torch.compile(net) if self.cfg.compile else net

    def _lr_warmup_steps(self) -> int:
        batches = len(self.train_loader)
        if self.cfg.steps_per_epoch:
            batches = min(batches, self.cfg.steps_per_epoch)
        return max(1, round(self.cfg.warmup_epochs * batches / self.cfg.grad_accum))

    @property
    def ckpt_path(self) -> Path:
        return Path(self.cfg.ckpt_dir or ".") / "last.pt"

    def _autocast(self) -> contextlib.AbstractContextManager:
        return autocast(self.precision, self.device)

    def _to_device(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(self.device, non_blocking=True, memory_format=self.memory_format)
        return x, y.to(self.device, non_blocking=True)

    def _progress(self, iterable: Any, total: int, desc: str) -> Any:
        if not (self.cfg.progress and cdist.is_main_process()):
            return iterable
        from tqdm.auto import tqdm

        return tqdm(iterable, total=total, desc=desc, leave=False, mininterval=1.0)

    # ------------------------------------------------------------------ #
    def train_epoch(self) -> tuple[float, Throughput]:
        """One pass over the training loader (or ``steps_per_epoch`` batches)."""
        self.model.train()
        start, n_batches, batches, total, count = self._epoch_start()
        meter = Throughput(self.device, untimed_steps=self.cfg.untimed_steps)
        accum = self.cfg.grad_accum
        it = self._progress(batches, n_batches - start, f"epoch {self.epoch}")
        self.epoch_complete = True
        meter.start()
        for i, (x, y) in enumerate(it, start=start):
            if i >= n_batches:
                break
            meter.data_ready()
            x, y = self._to_device(x, y)
            if not self._buckets_settled:
                self._settle_buckets(x)
            last_micro = (i + 1) % accum == 0 or i + 1 == n_batches
            # Skip DDP's all-reduce on all but the last micro-batch of an accumulation.
            sync_ctx = self.ddp.no_sync() if (self.ddp and not last_micro) else contextlib.nullcontext()
            with sync_ctx:
                with self._autocast():
                    loss = self.loss_fn(self.model(x), y)
                self.scaler.scale(loss / accum).backward()
            if last_micro:
                self.scaler.step(self.optimizer)
                self.scaler.update()
                self.optimizer.zero_grad(set_to_none=True)
                if self.scheduler is not None:
                    self.scheduler.step()
                self.global_step += 1
            total += loss.detach()
            count += 1
            if last_micro and self._stop_or_checkpoint(i + 1, n_batches, total, count):
                self.epoch_complete = False
                break
            meter.step_done(x.shape[0])
            if self.step_callback is not None:
                self.step_callback()
            if (i + 1) % self.cfg.log_every == 0 or i + 1 == n_batches:
                self._log_step(loss.item(), it, i + 1, n_batches)
        meter.stop()
        if hasattr(it, "close"):
            it.close()
        mean = total / max(count, 1)
        if cdist.get_world_size() > 1:  # report the mean over all ranks, not rank 0's
            torch.distributed.all_reduce(mean)
            mean /= cdist.get_world_size()
        return mean.item(), meter

    def _epoch_start(self) -> tuple[int, int, Iterator, torch.Tensor, int]:
        """The first batch of this epoch (after those a mid-epoch checkpoint had trained), the
        epoch's length, its batches from there, and the loss sum and count carried over."""
        resume, self._resume_in_epoch = self._resume_in_epoch or {}, None
        if resume and resume["world_size"] != cdist.get_world_size():
            cdist.print0(f"the checkpoint was written mid-epoch by {resume['world_size']} ranks, this run has "
                         f"{cdist.get_world_size()}: epoch {self.epoch} starts again from its first batch")
            resume = {}
        start = resume.get("batches", 0)
        set_epoch(self.train_loader, self.epoch)  # from its first batch: the epoch's full length
        n_batches = len(self.train_loader)
        if self.cfg.steps_per_epoch:
            n_batches = min(n_batches, self.cfg.steps_per_epoch)
        skipped = set_epoch(self.train_loader, self.epoch, skip_batches=start)
        batches = iter(self.train_loader) if skipped else itertools.islice(iter(self.train_loader), start, None)
        total = resume["loss_sums"][cdist.get_rank()].to(self.device).reshape(()) if start \
            else torch.zeros((), device=self.device)
        return start, n_batches, batches, total, resume.get("count", 0)

    def _log_step(self, loss: float, bar: Any, batch: int, n_batches: int) -> None:
        self.step_losses.append(loss)
        if self.writer:
            self.writer.add_scalar("loss/train_step", loss, self.global_step)
            self.writer.add_scalar("lr", self.optimizer.param_groups[0]["lr"], self.global_step)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{loss:.3f}")
        elif cdist.is_main_process() and time.monotonic() - self._last_line >= LINE_EVERY_S:
            # a batch log has no bar: a line now and then says the job is alive and where it is in a long epoch
            self._last_line = time.monotonic()
            print(f"epoch {self.epoch}: batch {batch}/{n_batches}, step {self.global_step}, loss {loss:.4f}",
                  flush=True)

    def _settle_buckets(self, x: torch.Tensor) -> None:
        """Let DDP reorder its gradient buckets before the first real step of a run.

        DDP rebuilds its buckets after its first backward pass, in the order the
        gradients became ready, and with three or more ranks that order decides in
        which order each gradient element is summed over the ranks. A run resumed
        from a checkpoint would take its first step with the initial buckets where
        the uninterrupted run, at that point, used the rebuilt ones: the same maths,
        other rounding. A zero-loss backward (no optimiser step; buffers such as
        BatchNorm's running statistics restored) settles the buckets in every run.
        """
        saved = {name: buf.clone() for name, buf in self.raw_model.named_buffers()}
        with self._autocast():
            zero = self.model(torch.zeros_like(x)).float().sum() * 0
        zero.backward()
        self.optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for name, buf in self.raw_model.named_buffers():
                buf.copy_(saved[name])
        self._buckets_settled = True

    def _stop_or_checkpoint(self, done: int, n_batches: int, total: torch.Tensor, count: int) -> bool:
        """After an optimiser step: the step checkpoint every ``ckpt_every_steps``, and
        True when every rank stops here (a stop request; all ranks agree on the step)."""
        stopping = self.stop.poll()
        self.stopped = self.stopped or stopping
        if done >= n_batches:
            return False  # the epoch is over: fit() writes its checkpoint
        every = self.cfg.ckpt_every_steps
        if self.cfg.ckpt_dir and (stopping or (every and self.global_step % every == 0)):
            # every rank's own running loss sum, so the resumed epoch reports the same mean
            sums = [total.detach().reshape(1)]
            if cdist.get_world_size() > 1:
                sums = [torch.empty_like(sums[0]) for _ in range(cdist.get_world_size())]
                torch.distributed.all_gather(sums, total.detach().reshape(1))
            self.save(self.ckpt_path, in_epoch={"batches": done, "count": count, "world_size": len(sums),
                                                "loss_sums": [s.cpu() for s in sums]})
        return stopping

    @torch.no_grad()
    def evaluate(self, loader: DataLoader | None = None) -> tuple[float, float]:
        """Mean loss and accuracy over ``loader`` (summed over all ranks)."""
        loader = loader or self.val_loader
        if loader is None:
            return float("nan"), float("nan")
        return evaluate(self.model, loader, self.device, self.precision, self.memory_format)

    def fit(self) -> list[EpochStats]:
        """Train until ``config.epochs``; resumes where a checkpoint left off."""
        while self.epoch < self.cfg.epochs:
            train_loss, meter = self.train_epoch()
            if not self.epoch_complete:
                break
            if not math.isfinite(train_loss):
                raise FloatingPointError(
                    f"training loss became {train_loss} in epoch {self.epoch}: lower the "
                    "learning rate, or use bf16/fp32 instead of fp16."
                )
            val_loss, val_acc = self.evaluate()
            stats = EpochStats(
                self.epoch, train_loss, val_loss, val_acc, meter.images_per_s, meter.data_fraction
            )
            self.history.append(stats)
            self.epoch += 1
            if self.writer:
                for key, value in asdict(stats).items():
                    if key != "epoch" and math.isfinite(value):
                        self.writer.add_scalar(f"epoch/{key}", value, stats.epoch)
                self.writer.flush()
            val = f"val_loss {val_loss:.4f}  val_acc {val_acc:.3f}  " if self.val_loader else ""
            cdist.print0(
                f"epoch {stats.epoch}: train_loss {train_loss:.4f}  {val}"
                f"{meter.images_per_s:,.0f} img/s/rank  data {100 * meter.data_fraction:.0f}%"
            )
            if self.cfg.ckpt_dir:
                self.save(self.ckpt_path)
            if self.epoch_callback is not None:
                self.epoch_callback(stats)
            if self.stopped:
                break
        self.stop.close()
        if self.stopped:
            where = f"checkpoint in {self.ckpt_path}" if self.cfg.ckpt_dir else "no checkpoint folder: nothing saved"
            cdist.print0(f"stopped on request ({self.stop.reason}) after step {self.global_step}, "
                         f"epoch {self.epoch}: {where}; the next run resumes there")
        if self.writer:
            self.writer.close()
        return self.history

    # ------------------------------------------------------------------ #
    def state_dict(self, in_epoch: dict[str, Any] | None = None) -> dict[str, Any]:
        """Everything a resumed run needs; ``in_epoch`` marks a mid-epoch checkpoint
        (batches of ``epoch`` already trained, and their loss sum and count)."""
        return {
            "model": self.raw_model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scaler": self.scaler.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "epoch": self.epoch,
            "in_epoch": in_epoch,
            "global_step": self.global_step,
            "history": [asdict(h) for h in self.history],
            "config": asdict(self.cfg),
            "rng": rng_state(),
        }

    def save(self, path: str | Path, in_epoch: dict[str, Any] | None = None) -> None:
        """Rank 0 writes atomically; the others wait so nobody reads a half-written file."""
        if cdist.is_main_process():
            save_checkpoint(self.state_dict(in_epoch), path)
        cdist.barrier()

    def _keep_configured_lr(self, saved_optimizer: dict[str, Any]) -> None:
        """The optimiser's and the warm-up's state carry the saved run's learning rate: rescale them to
        this run's (``self.lr``), at the same point of the warm-up. A run resumed with the same settings
        is untouched. The learning rate is not a setting a resumed run must keep (``same_on_resume``):
        a researcher lowers it after a plateau with ``--lr`` and resumes, and Population Based Training
        resumes a donor's checkpoint with a changed one; both get the lr they asked for."""
        group = saved_optimizer["param_groups"][0]
        saved_lr = group.get("initial_lr", group["lr"])  # the warm-up's target, else the lr itself
        if saved_lr == self.lr or saved_lr <= 0:
            return
        scale = self.lr / saved_lr
        for g in self.optimizer.param_groups:
            g["lr"] *= scale
            if "initial_lr" in g:
                g["initial_lr"] *= scale
        if self.scheduler is not None:
            self.scheduler.base_lrs = [lr * scale for lr in self.scheduler.base_lrs]
        cdist.print0(f"learning rate {self.lr:g} from this run's settings (the checkpoint's run used {saved_lr:g})")

    def resume_from(self, path: str | Path) -> bool:
        """Continue from the checkpoint at ``path`` (or the one before it, if that one is
        unreadable); False when there is none. A checkpoint written by another
        configuration (model, batch per rank, precision...) stops with one line."""
        found = load_latest(path, map_location=self.device, say=cdist.print0)
        if found is None:
            return False
        where, state = found
        differ = resume_mismatch(state.get("config") or {}, self.cfg)
        if differ:
            raise CheckpointError(
                f"{where} was written by another configuration ({'; '.join(differ)}): resume with the "
                "same settings, or point --ckpt-dir at a new folder (or pass --no-resume) to start afresh"
            )
        try:
            self.raw_model.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as exc:
            first = first_line(exc)
            raise CheckpointError(f"{where} holds another model or optimiser than this run builds ({first}); "
                                  "point --ckpt-dir at a new folder to start afresh") from exc
        self.scaler.load_state_dict(state["scaler"])
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._keep_configured_lr(state["optimizer"])
        self.epoch = state["epoch"]
        self._resume_in_epoch = state.get("in_epoch")
        self.global_step = state["global_step"]
        self.history = [EpochStats(**h) for h in state["history"]]
        if state.get("rng") is not None:
            set_rng_state(state["rng"])
        within = f" (after batch {self._resume_in_epoch['batches']})" if self._resume_in_epoch else ""
        self.resumed_from = {"path": str(where), "step": self.global_step,
                             "batch": self._resume_in_epoch["batches"] if self._resume_in_epoch else None}
        cdist.print0(f"resumed from {where} at epoch {self.epoch}{within}")
        return True


def build_trainer(cfg: TrainConfig, device: torch.device, **shape: Any) -> Trainer:
    """The course's run as ``cfg`` describes it: the data sets and their loaders, the model
    (``shape``: the CNN's width, depth, norm; ``models.build_model``) and the Trainer.
    scripts/train.py and each Ray Tune trial (``tuning.train_one``) start from here."""
    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
    pin = cfg.pin_memory and device.type == "cuda"
    train_loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers, pin_memory=pin,
                               persistent_workers=cfg.workers > 0, drop_last=True, seed=cfg.seed)
    val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, pin_memory=pin,
                             seed=cfg.seed)
    model = build_model(cfg.model, meta.channels, meta.num_classes, **shape)
    return Trainer(model, train_loader, device, cfg, val_loader=val_loader)


def history_table(history: list[EpochStats]) -> str:
    """The per-epoch history as a plain-text table."""
    rows = ["epoch  train_loss  val_loss  val_acc  img/s/rank  data%"]
    for h in history:
        rows.append(
            f"{h.epoch:5d}  {h.train_loss:10.4f}  {h.val_loss:8.4f}  {h.val_acc:7.3f}  "
            f"{h.images_per_s:10,.0f}  {100 * h.data_fraction:5.0f}"
        )
    return "\n".join(rows)
