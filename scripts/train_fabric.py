#!/usr/bin/env python
"""ddp_loop.py converted to Lightning Fabric with the smallest diff (notebook 06 prints it).

Fabric starts or joins the processes, picks each rank's device, wraps the model in DDP,
shards and moves the batches, runs autocast and the gradient scaler, and saves from rank 0.
The loop stays yours. --devices/--num-nodes are checked against the launcher as in
train_lightning.py. --grad-accum N accumulates N micro-batches (fabric.no_backward_sync: the
all-reduce only on the last). With --ckpt-dir it writes loop.pt each epoch (model, optimizer,
epoch), and a new run resumes from it (fabric.load).

    torchrun --standalone --nproc-per-node=2 scripts/train_fabric.py --epochs 2
"""

import argparse
import gc
import sys
from pathlib import Path

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy

from course_utils.config import add_config_args, config_from_args, unsupported
from course_utils.data import get_datasets, make_loader
from course_utils.errors import fail
from course_utils.process_group import cleanup, ranks_agree, ranks_per_host
from course_utils.hardware import peak_memory_mib
from course_utils.lit import LIGHTNING_PRECISION, add_launch_args, plan_launch, quiet_lightning
from course_utils.models import build_model
from course_utils.precision import resolve_precision
from course_utils.results import emit_result
from course_utils.rng import rng_state, set_rng_state
from course_utils.timing import Throughput
from course_utils.trainer import config_lr, evaluate, make_optimizer

LEFT_OUT = {"trace_dir", "warmup_epochs", "tf32", "cudnn_benchmark", "channels_last", "compile",
            "bucket_cap_mb", "grad_as_bucket_view", "ckpt_every_steps", "log_dir"}
parser = argparse.ArgumentParser(description=__doc__)
add_config_args(parser)
add_launch_args(parser)
args = parser.parse_args()
cfg = config_from_args(args)
try:
    unsupported(cfg, Path(__file__).name, LEFT_OUT)
    plan = plan_launch(cfg.device, args.devices, args.num_nodes)  # this rank's device from the course's policy
    precision = resolve_precision(cfg.precision, plan.device)
except ValueError as exc:
    sys.exit(fail(str(exc)))

quiet_lightning()
# each rank's device from the course's policy, handed to Fabric rather than counted by it (Fabric would put
# rank r on GPU r): right under Slurm's GPU binding too
several = plan.world_size > 1
fabric = Fabric(accelerator=plan.accelerator, num_nodes=plan.num_nodes,
                devices="auto" if several else [plan.device.index] if plan.device.type == "cuda" else 1,
                strategy=DDPStrategy(parallel_devices=[torch.device(d) for d in plan.parallel_devices])
                if several else "auto", precision=LIGHTNING_PRECISION[precision])
fabric.launch()  # joins torchrun's or srun's processes, or starts them
world, device, rank = fabric.world_size, fabric.device, fabric.global_rank

torch.manual_seed(cfg.seed)  # the same initial weights on every rank
train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
model = build_model(cfg.model, meta.channels, meta.num_classes)
optimizer = make_optimizer(model, cfg, config_lr(cfg, world))
model, optimizer = fabric.setup(model, optimizer)  # to the device, DDP, autocast
loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers,
                     pin_memory=plan.accelerator == "gpu" and cfg.pin_memory, drop_last=True, seed=cfg.seed)
val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, seed=cfg.seed)
loader, val_loader = fabric.setup_dataloaders(loader, val_loader)  # batches arrive on the device

losses, step, first_epoch, resumed_from = [], 0, 0, None
n_batches = min(len(loader), cfg.steps_per_epoch or len(loader))  # per epoch, on this rank
ckpt = Path(cfg.ckpt_dir) / "loop.pt" if cfg.ckpt_dir else None
if ckpt and cfg.resume and ckpt.exists():  # every rank reads it, onto its own device
    # restores these two in place and returns the rest (your own file: it may hold more than tensors)
    rest = fabric.load(ckpt, {"model": model, "optimizer": optimizer}, weights_only=False)
    first_epoch, losses, step = rest["epoch"], rest["losses"], rest["step"]
    resumed_from = {"path": str(ckpt), "epoch": first_epoch, "step": step}
    for _ in range(first_epoch):  # Fabric sets the sampler's epoch from the loader's iterations: start one per
        next(iter(loader), None)  # finished epoch (one batch read), so the next epoch shuffles as it would have
    set_rng_state(rest["rng"])  # augmentation draws from it: the next epoch sees the same images
for epoch in range(first_epoch, cfg.epochs):
    model.train()  # Fabric calls the sampler's set_epoch each time the loader is iterated
    meter, total, count = Throughput(device, untimed_steps=cfg.untimed_steps), 0.0, 0
    meter.start()
    for i, (x, y) in enumerate(loader):
        if i == n_batches:
            break
        meter.data_ready()
        boundary = (i + 1) % cfg.grad_accum == 0 or i + 1 == n_batches  # an optimizer step's last micro-batch
        with fabric.no_backward_sync(model, enabled=not boundary):  # all-reduce on the last only
            loss = torch.nn.functional.cross_entropy(model(x), y)
            fabric.backward(loss / cfg.grad_accum)  # DDP all-reduces the gradients during backward
        if boundary:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        meter.step_done(len(y))
        total, count = total + loss.detach(), count + 1  # no .item(): no host sync per step
    meter.stop()
    losses.append(float(total) / max(count, 1))
    if rank == 0:  # (fabric.print prints once per node: on local rank 0)
        print(f"epoch {epoch}: train loss {losses[-1]:.4f}, {meter.images_per_s:,.0f} images/s", flush=True)
    if ckpt:  # Fabric writes from rank 0
        fabric.save(ckpt, {"model": model, "optimizer": optimizer, "epoch": epoch + 1, "losses": losses, "step": step,
                          "rng": rng_state()})

val_loss, val_acc = evaluate(model, val_loader, device, precision)
emit_result({"trainer": Path(__file__).name, "world_size": world, "hosts": ranks_per_host(),
             "ranks_agree": ranks_agree(model), "device": str(device), "epochs": cfg.epochs, "global_step": step,
             "resumed_from": resumed_from,
             "train_loss": losses, "val_loss": val_loss, "val_acc": val_acc,
             "images_per_s_per_rank": meter.images_per_s, "peak_memory_mib": peak_memory_mib(device)})
del model, optimizer, loader, val_loader  # DDP holds the group in reference cycles: free it before the exit
gc.collect()
cleanup()
