#!/usr/bin/env python
"""The course's training run under PyTorch's FSDP2 (`fully_shard`, notebook 07): the run of
train_deepspeed.py --zero-stage 3 without DeepSpeed, and the bytes each rank holds measured.

    torchrun --standalone --nproc-per-node=2 scripts/train_fsdp.py --model mlp --optimizer adamw \\
        --lr 1e-3 --precision bf16

Each block of the model (each element of a ModuleList, each other child with weights) becomes a
unit whose weights are gathered just before it runs and freed after; every rank keeps a 1/N shard
in fp32 (the master copy), computes in bf16 and reduces gradients in fp32.
--no-reshard-after-forward keeps the gathered weights from the forward to the backward pass (one
all-gather less per step, more memory: ZeRO-2's trade). Launch with torchrun or srun.

The model is built on the meta device (shapes, no memory), sharded, and only then given memory
(to_empty); rank 0 builds the initial weights whole on its CPU and each rank takes its shards
(a large model would load them from a checkpoint instead). With --ckpt-dir every rank writes its
shards each epoch (torch.distributed.checkpoint); a new run resumes from them on any number of ranks,
and rank 0 turns the last one into one plain state dict (consolidated.pt).
"""

import argparse
import gc
import sys
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from course_utils.checkpoint import (
    CheckpointError,
    consolidate_sharded,
    ensure_writable_dir,
    latest_sharded,
    load_sharded,
    save_sharded,
    weights_digest,
)
from course_utils.config import add_config_args, config_from_args, in_run_dir, resume_mismatch
from course_utils.data import get_datasets, make_loader, set_epoch
from course_utils.errors import fail
from course_utils.hardware import peak_memory_mib
from course_utils.models import build_model, count_parameters, enable_activation_checkpointing
from course_utils.process_group import parallel_mesh, ranks_agree, ranks_per_host
from course_utils.results import emit_result
from course_utils.rng import rng_state_json, set_rng_state_json
from course_utils.sharding import (
    add_sharding_args,
    fsdp_gradient_bytes,
    fsdp_memory,
    fsdp_precision,
    shard_units,
    start_rank,
)
from course_utils.timing import Throughput
from course_utils.trainer import config_lr, evaluate, make_optimizer

LEFT_OUT = {"trace_dir", "warmup_epochs", "tf32", "cudnn_benchmark", "channels_last", "compile", "bucket_cap_mb",
            "grad_as_bucket_view", "ckpt_every_steps", "log_dir"}
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_config_args(parser)
fsdp_args = add_sharding_args(parser, "fsdp")
fsdp_args.add_argument("--reshard-after-forward", action=argparse.BooleanOptionalAction, default=True,
                       help="free the gathered weights after the forward pass (default: yes)")
fsdp_args.add_argument("--sync-every-micro-batch", action="store_true",
                       help="with --grad-accum: reduce-scatter each micro-batch's gradients (less memory: no whole "
                            "gradients held between micro-batches; more communication)")
args = parser.parse_args()
cfg = in_run_dir(config_from_args(args), logs=False)  # in a course Slurm job: RUN_DIR/ckpt by default
# the course's door forms the group (this rank's GPU set before it exists; one process: a group of one)
info, device, resolved = start_rank(cfg, Path(__file__).name, LEFT_OUT, args.activation_checkpointing)
world, rank = info.world_size, info.rank
try:
    precision, note = fsdp_precision(cfg.precision, resolved)
except ValueError as exc:
    sys.exit(fail(str(exc)))
if note and rank == 0:
    print(note, file=sys.stderr, flush=True)
mesh = parallel_mesh(device)["dp"]  # the ranks the weights are sharded across

torch.manual_seed(cfg.seed)  # the same initial weights on every rank, before sharding
train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
# rank 0's whole initial weights, drawn as every trainer of the course draws them; the other ranks hold none
initial = build_model(cfg.model, meta.channels, meta.num_classes).state_dict() if rank == 0 else {}
rng = [torch.get_rng_state()]
dist.broadcast_object_list(rng, src=0)  # every rank's random stream where rank 0's is now, as if each had built it
torch.set_rng_state(rng[0])
with torch.device("meta"):  # shapes only: nothing is allocated until each rank holds just its shards
    model = build_model(cfg.model, meta.channels, meta.num_classes)
if args.activation_checkpointing:
    enable_activation_checkpointing(model)
psi = count_parameters(model)
policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if precision == "bf16" else None, reduce_dtype=torch.float32)
for unit in shard_units(model):  # each block, then the whole model: one block's weights gathered at a time
    fully_shard(unit, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward)
fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=args.reshard_after_forward)
model.to_empty(device=device)  # memory for this rank's shards, uninitialised
set_model_state_dict(model, initial, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
del initial
optimizer = make_optimizer(model, cfg, config_lr(cfg, world))  # on the shards: each rank steps its 1/N
loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers,
                     pin_memory=device.type == "cuda" and cfg.pin_memory, drop_last=True, seed=cfg.seed)
val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, seed=cfg.seed)

losses, step, grad_bytes, first_epoch, resumed_from = [], 0, 0, 0, None
ckpt = ensure_writable_dir(cfg.ckpt_dir, "checkpoint folder") if cfg.ckpt_dir else None
saved = latest_sharded(ckpt) if ckpt and cfg.resume else None
if saved:
    try:
        progress = load_sharded(saved, model, optimizer)  # this rank's part of the shards, whatever N wrote them
    except CheckpointError as exc:
        sys.exit(fail(str(exc)))
    mismatch = resume_mismatch(progress["config"], cfg)
    if mismatch:
        sys.exit(fail(f"{ckpt} was written by another run ({'; '.join(mismatch)}): use a new --ckpt-dir"))
    first_epoch, step, losses = progress["epoch"], progress["step"], progress["losses"]
    if "rng" in progress:  # augmentation in this process draws from it: the next epoch sees the same images
        set_rng_state_json(progress["rng"])
    resumed_from = {"path": str(saved), "world_size": progress["world_size"], "step": step,
                    "weights": weights_digest(p.full_tensor() for p in model.parameters())}  # (gathers: every rank)
    if rank == 0:
        print(f"resumed from {saved} after epoch {first_epoch} (step {step}), written by {progress['world_size']} "
              f"rank(s), now on {world}", flush=True)
for epoch in range(first_epoch, cfg.epochs):
    set_epoch(loader, epoch)  # a new shuffle every epoch, the same on every rank
    model.train()
    meter, total, count = Throughput(device, untimed_steps=cfg.untimed_steps), 0.0, 0
    meter.start()
    for i, (x, y) in enumerate(loader):
        if i == cfg.steps_per_epoch:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        meter.data_ready()
        boundary = (i + 1) % cfg.grad_accum == 0
        # off: accumulate whole (unsharded, fp32) gradients locally and reduce-scatter on the last micro-batch
        model.set_requires_gradient_sync(boundary or args.sync_every_micro_batch)
        loss = nn.functional.cross_entropy(model(x).float(), y)  # inputs cast to bf16 by the policy
        (loss / cfg.grad_accum).backward()  # gathers each unit's weights again, reduce-scatters its gradients
        grad_bytes = max(grad_bytes, fsdp_gradient_bytes(model))
        if boundary:
            if args.gradient_clipping:
                nn.utils.clip_grad_norm_(model.parameters(), args.gradient_clipping)  # the norm over all shards
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
        meter.step_done(len(y))
        total, count = total + loss.detach(), count + 1
    meter.stop()
    losses.append(float(total) / max(count, 1))  # one host sync per epoch, not per step
    if rank == 0:
        print(f"epoch {epoch}: train loss {losses[-1]:.4f}, {meter.images_per_s:,.0f} images/s", flush=True)
    if ckpt:
        save_sharded(ckpt, model, optimizer, {"epoch": epoch + 1, "step": step, "losses": losses,
                                              "world_size": world, "config": asdict(cfg), "rng": rng_state_json()})

memory = fsdp_memory(model, optimizer, grad_bytes)
# FSDP2 splits each tensor by rows (torch.chunk): where the rows are not a multiple of N the first ranks hold one more
# (the 10-class head on 4 ranks: 3, 3, 3, 1 rows), so rank 0's bytes exceed psi/N; their mean over the ranks is it
parts = ("params", "gradients", "optimizer")
held = torch.tensor([float(memory[k]) for k in parts], dtype=torch.float64, device=device)
dist.all_reduce(held)
memory.update({k: held[i].item() / world for i, k in enumerate(parts)})
allocated = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None
val_loss, val_acc = evaluate(model, val_loader, device)  # the policy casts to bf16 already
for unit in model.modules():  # without --reshard-after-forward the last forward left the weights gathered
    if isinstance(unit, FSDPModule):
        unit.reshard()
whole = nn.ParameterList(nn.Parameter(p.full_tensor()) for p in model.parameters())  # gathered: compare
consolidated_diff = None
if ckpt and rank == 0 and latest_sharded(ckpt):  # one plain file: the model without FSDP
    plain = consolidate_sharded(latest_sharded(ckpt), ckpt / "consolidated.pt")
    consolidated_diff = max(float((plain[name.replace("_checkpoint_wrapped_module.", "")] - w.detach().cpu()).abs().max())
                            for (name, _), w in zip(model.named_parameters(), whole, strict=True))
emit_result({"trainer": Path(__file__).name, "world_size": world, "hosts": ranks_per_host(),
             "ranks_agree": ranks_agree(whole), "device": str(device), "precision": precision,
             "reshard_after_forward": args.reshard_after_forward, "sync_every_micro_batch": args.sync_every_micro_batch,
             "activation_checkpointing": args.activation_checkpointing, "epochs": cfg.epochs, "global_step": step,
             "train_loss": losses, "val_loss": val_loss, "val_acc": val_acc,
             "images_per_s_per_rank": meter.images_per_s, "psi": psi, "memory": memory, "allocated_mib": allocated,
             "resumed_from": resumed_from, "final_weights": weights_digest(whole),
             "consolidated_max_abs_diff": consolidated_diff, "peak_memory_mib": peak_memory_mib(device)})
dist.barrier()
del model, optimizer, whole
gc.collect()
dist.destroy_process_group()
