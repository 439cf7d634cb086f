#!/usr/bin/env python
"""Notebook 03's DDP training loop written out by hand: what train.py's Trainer does, on one screen.

Notebook 06 turns it into train_fabric.py with the smallest diff. The flags are train.py's;
those this loop leaves out stop it with one line. --grad-accum N accumulates N micro-batches
(the all-reduce only on the last, under DDP's no_sync). With --ckpt-dir it writes loop.pt each
epoch (model, optimizer, epoch), and a new run resumes from it.

    torchrun --standalone --nproc-per-node=2 scripts/ddp_loop.py --epochs 2
"""

import argparse
import contextlib
import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils.checkpoint import load_checkpoint, save_checkpoint
from course_utils.config import add_config_args, config_from_args, unsupported
from course_utils.data import get_datasets, make_loader, set_epoch
from course_utils.devices import PlacementError
from course_utils.errors import fail
from course_utils.process_group import RendezvousError, init_distributed, ranks_agree, ranks_per_host
from course_utils.hardware import peak_memory_mib
from course_utils.models import build_model
from course_utils.precision import autocast, resolve_precision
from course_utils.results import emit_result
from course_utils.rng import rng_state, set_rng_state
from course_utils.timing import Throughput
from course_utils.trainer import config_lr, evaluate, make_optimizer

LEFT_OUT = {"trace_dir", "warmup_epochs", "tf32", "cudnn_benchmark", "channels_last", "compile",
            "bucket_cap_mb", "grad_as_bucket_view", "ckpt_every_steps", "log_dir"}
parser = argparse.ArgumentParser(description=__doc__)
add_config_args(parser)
cfg = config_from_args(parser.parse_args())
try:
    unsupported(cfg, Path(__file__).name, LEFT_OUT)
except ValueError as exc:
    sys.exit(fail(str(exc)))

try:  # join the group: a GPU per rank (set_device before the group, NCCL), else every rank on the CPU (gloo)
    info, device = init_distributed(cfg.device)  # RANK, MASTER_ADDR, ... from torchrun or srun
except (ValueError, PlacementError, RendezvousError) as exc:
    sys.exit(fail(str(exc)))
use_gpu, rank, world = device.type == "cuda", info.rank, info.world_size
precision = resolve_precision(cfg.precision, device)
scaler = torch.amp.GradScaler("cuda", enabled=precision == "fp16")

torch.manual_seed(cfg.seed)  # the same initial weights on every rank
train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
model = build_model(cfg.model, meta.channels, meta.num_classes).to(device)
if world > 1:
    model = DDP(model, device_ids=[device.index] if use_gpu else None)
optimizer = make_optimizer(model, cfg, config_lr(cfg, world))
loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers,
                     pin_memory=use_gpu and cfg.pin_memory, drop_last=True, seed=cfg.seed)  # each rank its slice
val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, seed=cfg.seed)

losses, step, first_epoch = [], 0, 0
n_batches = min(len(loader), cfg.steps_per_epoch or len(loader))  # per epoch, on this rank
ckpt = Path(cfg.ckpt_dir) / "loop.pt" if cfg.ckpt_dir else None
if ckpt and cfg.resume and ckpt.exists():  # every rank reads it, onto its own device
    state = load_checkpoint(ckpt, map_location=device)
    (model.module if world > 1 else model).load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    first_epoch, losses, step = state["epoch"], state["losses"], state["step"]
    set_rng_state(state["rng"])  # augmentation draws from it: the next epoch sees the same images
for epoch in range(first_epoch, cfg.epochs):
    set_epoch(loader, epoch)  # a new shuffle every epoch, the same on every rank
    model.train()
    meter, total, count = Throughput(device, untimed_steps=cfg.untimed_steps), 0.0, 0
    meter.start()
    for i, (x, y) in enumerate(loader):
        if i == n_batches:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        meter.data_ready()
        boundary = (i + 1) % cfg.grad_accum == 0 or i + 1 == n_batches  # an optimizer step's last micro-batch
        with model.no_sync() if world > 1 and not boundary else contextlib.nullcontext():  # all-reduce on the last only
            with autocast(precision, device):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss / cfg.grad_accum).backward()  # DDP all-reduces the gradients during backward
        if boundary:
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        meter.step_done(len(y))
        total, count = total + loss.detach(), count + 1  # no .item(): no host sync per step
    meter.stop()
    losses.append(float(total) / max(count, 1))
    if rank == 0:
        print(f"epoch {epoch}: train loss {losses[-1]:.4f}, {meter.images_per_s:,.0f} images/s", flush=True)
    if ckpt and rank == 0:  # one writer
        save_checkpoint({"model": (model.module if world > 1 else model).state_dict(), "optimizer": optimizer.state_dict(),
                         "epoch": epoch + 1, "losses": losses, "step": step, "rng": rng_state()}, ckpt)

val_loss, val_acc = evaluate(model, val_loader, device, precision)
emit_result({"trainer": Path(__file__).name, "world_size": world, "hosts": ranks_per_host(),
             "ranks_agree": ranks_agree(model), "device": str(device), "epochs": cfg.epochs, "global_step": step,
             "train_loss": losses, "val_loss": val_loss, "val_acc": val_acc,
             "images_per_s_per_rank": meter.images_per_s, "peak_memory_mib": peak_memory_mib(device)})
if world > 1:  # DDP holds the group in reference cycles: free it before the interpreter exits
    dist.barrier()
    del model, optimizer
    gc.collect()
    dist.destroy_process_group()
