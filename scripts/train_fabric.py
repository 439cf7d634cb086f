#!/usr/bin/env python
"""ddp_loop.py converted to Lightning Fabric with the smallest diff (notebook 06 prints it).

Fabric starts or joins the processes, picks each rank's device, wraps the model in DDP,
shards and moves the batches, runs autocast and the gradient scaler, and saves from rank 0.
The loop stays yours. --devices/--num-nodes are checked against the launcher as in
train_lightning.py. With --ckpt-dir it writes loop.pt each epoch.

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
from course_utils.dist import cleanup, ranks_agree, ranks_per_host
from course_utils.hardware import peak_memory_mib
from course_utils.lit import LIGHTNING_PRECISION, add_launch_args, placement_args, plan_launch, quiet_lightning
from course_utils.models import build_model
from course_utils.precision import resolve_precision
from course_utils.results import emit_result
from course_utils.timing import Throughput
from course_utils.trainer import config_lr, evaluate, make_optimizer

LEFT_OUT = {"grad_accum", "warmup_epochs", "tf32", "cudnn_benchmark", "channels_last", "compile",
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
    sys.exit(f"error: {exc}")

quiet_lightning()
# each rank's device handed to Fabric, not counted by Fabric: right under Slurm's GPU binding too
fabric = Fabric(**placement_args(plan, DDPStrategy), precision=LIGHTNING_PRECISION[precision])
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

losses, step = [], 0
for epoch in range(cfg.epochs):
    model.train()  # Fabric calls the sampler's set_epoch each time the loader is iterated
    meter, total, count = Throughput(device, untimed_steps=cfg.untimed_steps), 0.0, 0
    meter.start()
    for i, (x, y) in enumerate(loader):
        if i == cfg.steps_per_epoch:
            break
        meter.data_ready()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad(set_to_none=True)
        fabric.backward(loss)  # DDP all-reduces the gradients during backward
        optimizer.step()
        meter.step_done(len(y))
        total, count, step = total + loss.detach(), count + 1, step + 1
    meter.stop()
    losses.append(float(total) / max(count, 1))  # one host sync per epoch, not per step
    if rank == 0:  # (fabric.print prints once per node: on local rank 0)
        print(f"epoch {epoch}: train loss {losses[-1]:.4f}, {meter.images_per_s:,.0f} images/s", flush=True)
    if cfg.ckpt_dir:  # Fabric writes from rank 0
        fabric.save(Path(cfg.ckpt_dir) / "loop.pt", {"model": model, "epoch": epoch + 1})

val_loss, val_acc = evaluate(model, val_loader, device, precision)
emit_result({"trainer": Path(__file__).name, "world_size": world, "hosts": ranks_per_host(),
             "ranks_agree": ranks_agree(model), "device": str(device), "epochs": cfg.epochs, "global_step": step,
             "train_loss": losses, "val_loss": val_loss, "val_acc": val_acc,
             "images_per_s_per_rank": meter.images_per_s, "peak_memory_mib": peak_memory_mib(device)})
del model, optimizer, loader, val_loader  # DDP holds the group in reference cycles: free it before the exit
gc.collect()
cleanup()
