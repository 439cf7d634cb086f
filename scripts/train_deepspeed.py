#!/usr/bin/env python
"""The course's training run under DeepSpeed ZeRO (notebook 07): the loop of ddp_loop.py, with the
DeepSpeed engine in place of DDP, and the bytes each rank holds measured by stage.

    torchrun --standalone --nproc-per-node=2 scripts/train_deepspeed.py --model mlp --optimizer adamw \\
        --lr 1e-3 --precision bf16 --zero-stage 2

Launch it with torchrun, or with srun (slurm/*/multi_node_deepspeed.sbatch), like every course
script. Not with the `deepspeed` launcher: it starts the ranks of other nodes over passwordless ssh
from a hostfile, which many clusters forbid. The optimizer is the course's (--optimizer); with
--ckpt-dir the engine writes a ZeRO checkpoint each epoch and a new run resumes from it: on the same
number of ranks, or, with --universal, on any number once ds_to_universal has converted it.
"""

import argparse
import gc
import os
import pickle
import shutil
import sys
import zipfile
from dataclasses import asdict
from pathlib import Path

import torch

from course_utils.checkpoint import weights_digest
from course_utils.config import add_config_args, config_from_args, in_run_dir, resume_mismatch
from course_utils.data import get_datasets, make_loader, set_epoch
from course_utils.errors import fail, first_line
from course_utils.hardware import peak_memory_mib
from course_utils.models import build_model, count_parameters, enable_activation_checkpointing
from course_utils.process_group import ranks_agree, ranks_per_host
from course_utils.results import emit_result
from course_utils.rng import rng_state, set_rng_state
from course_utils.sharding import (
    add_sharding_args,
    deepspeed_device_env,
    deepspeed_env,
    ds_config,
    start_counting_collectives,
    start_rank,
    stop_counting_collectives,
    zero_gradient_bytes,
    zero_memory,
    zero_theory,
)
from course_utils.timing import Throughput
from course_utils.trainer import config_lr, evaluate, make_optimizer

LEFT_OUT = {"trace_dir", "warmup_epochs", "tf32", "cudnn_benchmark", "channels_last", "compile", "bucket_cap_mb",
            "grad_as_bucket_view", "ckpt_every_steps", "log_dir"}
parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
add_config_args(parser)
deepspeed_args = add_sharding_args(parser, "deepspeed")
deepspeed_args.add_argument("--zero-stage", type=int, choices=(0, 1, 2, 3), default=2, help="(default: 2)")
deepspeed_args.add_argument("--offload-optimizer", action="store_true",
                            help="keep the fp32 master weights and the optimizer's moments in CPU memory")
deepspeed_args.add_argument("--universal", action="store_true",
                            help="resume from the Universal Checkpoint in --ckpt-dir (its latest_universal, written by "
                                 "python -m deepspeed.checkpoint.ds_to_universal): on any number of ranks")
args = parser.parse_args()
if args.offload_optimizer and args.zero_stage == 0:  # DeepSpeed would run on and leave the optimizer on the GPU
    parser.exit(2, "error: --offload-optimizer moves ZeRO's optimizer shards to the CPU, and stage 0 has none: "
                   "add --zero-stage 1, 2 or 3\n")
cfg = in_run_dir(config_from_args(args), logs=False)  # in a course Slurm job: RUN_DIR/ckpt by default
# the course's door forms the group (this rank's GPU set before it exists); DeepSpeed then uses that group
info, device, precision = start_rank(cfg, Path(__file__).name, LEFT_OUT, args.activation_checkpointing)
os.environ.update(deepspeed_env(use_gpu=device.type == "cuda"))
os.environ.update(deepspeed_device_env(device, os.environ))  # DeepSpeed sets the device from LOCAL_RANK itself
import deepspeed  # noqa: E402  (after deepspeed_env: DeepSpeed picks its accelerator on import)
from deepspeed.runtime.zero.utils import ZeRORuntimeException  # noqa: E402

deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")  # one process: a group of one


def full_weights_digest(engine, stage: int) -> str | None:
    """The fingerprint of the whole fp32 weights (ZeRO's master copy; stage 3 gathers it: every rank calls this)."""
    if stage == 0:
        return None  # no ZeRO optimizer holds a master copy to assemble
    from deepspeed.utils import safe_get_full_fp32_param

    full = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
    return None if any(t is None for t in full) else weights_digest(full)


world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()

torch.manual_seed(cfg.seed)  # the same initial weights on every rank
train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
model = build_model(cfg.model, meta.channels, meta.num_classes)
if args.activation_checkpointing:
    enable_activation_checkpointing(model)
psi = count_parameters(model)
config = ds_config(cfg, world, args.zero_stage, precision, args.offload_optimizer, args.gradient_clipping,
                   use_gpu=device.type == "cuda")
if args.universal:  # each parameter's fp32 weights and moments whole on disk: re-sharded for this run's ranks
    config["checkpoint"] = {"load_universal": True}
engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=make_optimizer(model, cfg, config_lr(cfg, world)),
                                               config=config)
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)  # the engine's weights
loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers,
                     pin_memory=device.type == "cuda" and cfg.pin_memory, drop_last=True, seed=cfg.seed)
val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, seed=cfg.seed)

losses, first_epoch, resumed_from = [], 0, None
ckpt = Path(cfg.ckpt_dir) if cfg.ckpt_dir else None
latest = ckpt / ("latest_universal" if args.universal else "latest") if ckpt else None
if args.universal and not (ckpt and latest.exists()):
    sys.exit(fail(f"--universal resumes from a Universal Checkpoint and {latest or 'no --ckpt-dir'} is not there: "
             f"convert a ZeRO checkpoint first (python -m deepspeed.checkpoint.ds_to_universal --input_folder "
             f"CKPT/<tag> --output_folder CKPT/universal-<tag>)"))
if ckpt and cfg.resume and latest.exists():
    try:
        loaded, client = engine.load_checkpoint(str(ckpt))  # every rank reads its own shard
        if loaded is None:  # DeepSpeed only warns when the files 'latest' names are not there
            raise FileNotFoundError(f"'{latest.name}' names {latest.read_text().strip()!r}, which is not there")
    except ZeRORuntimeException as exc:  # DeepSpeed's check of the number of ranks that wrote the shards
        reason = first_line(exc, limit=200)
        tag = latest.read_text().strip()
        sys.exit(fail(f"{ckpt} holds a ZeRO checkpoint of another number of ranks ({reason}): convert it with "
                 f"python -m deepspeed.checkpoint.ds_to_universal --input_folder {ckpt / tag} --output_folder "
                 f"{ckpt / ('universal-' + tag)}, then resume with --universal"))
    except (AssertionError, OSError, RuntimeError, KeyError, ValueError, EOFError, pickle.UnpicklingError,
            zipfile.BadZipFile) as exc:  # DeepSpeed's own checks are asserts
        reason = first_line(exc, limit=200)
        sys.exit(fail(f"{ckpt} holds no ZeRO checkpoint this run can read ({reason}): give --ckpt-dir a folder "
                 f"written by train_deepspeed.py (same --zero-stage, same number of ranks), or a new folder"))
    mismatch = resume_mismatch(client.get("config", {}), cfg)
    if mismatch:
        sys.exit(fail(f"{ckpt} was written by another run ({'; '.join(mismatch)}): use a new --ckpt-dir"))
    first_epoch, losses = client.get("epoch", 0), client.get("losses", [])
    if "rng" in client:  # augmentation draws from it: the next epoch sees the same images
        set_rng_state(client["rng"])
    resumed_from = {"path": str(ckpt / latest.read_text().strip()), "epoch": first_epoch, "universal": args.universal,
                    "step": engine.global_steps, "weights": full_weights_digest(engine, args.zero_stage)}
    if rank == 0:  # the engine restored its step count with the state
        print(f"resumed from {ckpt} after epoch {first_epoch} (step {engine.global_steps})", flush=True)

grad_bytes, images_per_s, counted = 0, None, None  # (None: every epoch was done before this run)
# collectives are counted over the untimed first steps only, then both counts are switched off (the logger syncs
# every call, the dispatcher's count runs Python for every op)
first_step, count_window = engine.global_steps, max(1, cfg.untimed_steps // cfg.grad_accum)
counter = start_counting_collectives()
for epoch in range(first_epoch, cfg.epochs):
    set_epoch(loader, epoch)  # a new shuffle every epoch, the same on every rank
    engine.train()
    meter, total, count = Throughput(device, untimed_steps=cfg.untimed_steps), 0.0, 0
    meter.start()
    for i, (x, y) in enumerate(loader):
        if i == cfg.steps_per_epoch:
            break
        x, y = x.to(device, dtype, non_blocking=True), y.to(device, non_blocking=True)
        meter.data_ready()
        loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
        engine.backward(loss)  # reduces the gradients (stage 2-3: into each rank's shard)
        grad_bytes = max(grad_bytes, zero_gradient_bytes(engine, optimizer))
        engine.step()  # at the accumulation boundary: clip, optimizer step on this rank's shard, gather
        if counted is None and engine.global_steps - first_step >= count_window:
            counted = stop_counting_collectives(counter, engine.global_steps - first_step, world)
        meter.step_done(len(y))
        total, count = total + loss.detach(), count + 1  # no .item(): no host sync per step
    meter.stop()
    losses.append(float(total) / max(count, 1))
    images_per_s = meter.images_per_s
    if rank == 0:
        print(f"epoch {epoch}: train loss {losses[-1]:.4f}, {images_per_s:,.0f} images/s", flush=True)
    if ckpt:
        tag = f"epoch{epoch + 1}"
        engine.save_checkpoint(str(ckpt), tag=tag, client_state={
            "epoch": epoch + 1, "losses": losses, "config": asdict(cfg), "rng": rng_state()})  # each rank its shard
        torch.distributed.barrier()
        if rank == 0:  # "latest" names the new one: the older ones can go
            for old in ckpt.glob("epoch*"):
                if old.name != tag:
                    shutil.rmtree(old, ignore_errors=True)

if counted is None:  # fewer steps than the window: count them all (none, when every epoch was done before)
    counted = stop_counting_collectives(counter, max(engine.global_steps - first_step, 1), world)
memory = zero_memory(engine, optimizer, grad_bytes)
allocated = torch.cuda.memory_allocated(device) / 2**20 if device.type == "cuda" else None  # the model state, now
consolidated_diff = None
if ckpt and args.zero_stage > 0:  # zero_to_fp32: one plain fp32 state dict from the shards on disk
    from deepspeed.utils import safe_get_full_fp32_param
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = {name: safe_get_full_fp32_param(p) for name, p in engine.module.named_parameters()}  # gathers
    if rank == 0:
        plain = get_fp32_state_dict_from_zero_checkpoint(str(ckpt))
        consolidated_diff = max((plain[name].float() - full[name].cpu()).abs().max().item() for name in full)
    torch.distributed.barrier()

final_weights = full_weights_digest(engine, args.zero_stage)
val_loss, val_acc = evaluate(engine.module, val_loader, device, precision)
with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):  # stage 3: whole weights to compare
    agree = ranks_agree(engine.module)
emit_result({"trainer": Path(__file__).name, "world_size": world, "hosts": ranks_per_host(), "ranks_agree": agree,
             "device": str(device), "precision": precision, "zero_stage": args.zero_stage,
             "offload_optimizer": args.offload_optimizer, "activation_checkpointing": args.activation_checkpointing,
             "epochs": cfg.epochs, "global_step": engine.global_steps, "train_loss": losses, "val_loss": val_loss,
             "val_acc": val_acc, "images_per_s_per_rank": images_per_s, "psi": psi, "memory": memory,
             "theory": zero_theory(psi, world, args.zero_stage, precision, cfg.optimizer, cfg.momentum),
             "collectives": counted,  # per optimizer step, by DeepSpeed's comms logger and at the dispatcher
             "consolidated_max_abs_diff": consolidated_diff, "allocated_mib": allocated, "resumed_from": resumed_from,
             "final_weights": final_weights,
             "peak_memory_mib": peak_memory_mib(device)})
torch.distributed.barrier()
del engine, optimizer
gc.collect()
torch.distributed.destroy_process_group()
# DeepSpeed keeps its process groups in module-level state: left to the interpreter's finalization, gloo's threads
# can be torn down without the GIL and abort the process after all its work is done ("terminate called without an
# active exception", seen once in a fresh-clone run of notebook 07). Everything is written: leave now.
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
