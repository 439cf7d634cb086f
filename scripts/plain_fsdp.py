#!/usr/bin/env python
"""plain_ddp.py with FSDP2 instead of DDP, as a researcher writes it: no course_utils. Each rank holds a shard
of every layer's weights, gradients and optimizer state, and gathers a layer's weights only to compute it. The
lines that differ from plain_ddp.py are the lesson (notebook 07 shows the diff): fully_shard per layer and on
the whole model, mixed precision as FSDP2's policy instead of autocast, and a sharded checkpoint (DCP) after
every epoch that the same command resumes from.

    torchrun --standalone --nproc-per-node=2 scripts/plain_fsdp.py --epochs 3 --ckpt-dir runs/plain-fsdp
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.utils.data import DataLoader, DistributedSampler

from plain_parts import build_model, evaluate, get_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="per rank: a step averages ranks x this")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--n-train", type=int, default=4096, help="images of the offline data set")
parser.add_argument("--n-val", type=int, default=1024, help="held-out images of the offline data set")
parser.add_argument("--data", default=None, help="a folder with torchvision's MNIST, instead of the offline data")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
parser.add_argument("--ckpt-dir", default=None, help="a sharded checkpoint after every epoch; the same again resumes")
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun, or by slurm/lib/torch_env.sh under srun
use_gpu = torch.cuda.is_available()  # the same answer on every rank: all NCCL, or all gloo
if use_gpu and local_rank >= torch.cuda.device_count():  # NCCL never shares a GPU between ranks
    sys.exit(f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} GPU(s): "
             "start one process per GPU (torchrun --nproc-per-node, srun --ntasks-per-node)")
device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
if use_gpu:  # this rank's GPU, before the group exists: NCCL and every later allocation use it, not GPU 0
    torch.cuda.set_device(device)
dist.init_process_group("nccl" if use_gpu else "gloo",  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from the environment
                        device_id=device if use_gpu else None)
rank, world = dist.get_rank(), dist.get_world_size()
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100). FSDP2 casts each layer's
# weights for its compute and reduces the gradients in fp32. fp16 would need a sharded gradient scaler: fp32 before 8
bf16 = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 8
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()

torch.manual_seed(0)  # the same initial weights on every rank, before each keeps only its shard of them
model = build_model().to(device)
for layer in model:  # a unit per layer with weights (a transformer's: per block): gathered, computed, freed
    if list(layer.parameters()):
        fully_shard(layer, mp_policy=mp)
fully_shard(model, mp_policy=mp)  # the root: what no layer holds, and the forward's start and end
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
dataset = get_dataset(args.n_train, args.data)
sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)  # a disjoint 1/world of it per rank
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    num_workers=args.workers, pin_memory=device.type == "cuda")
val_set = get_dataset(args.n_val, args.data, train=False)  # each rank scores its 1/world: no shuffle, no drop
val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))

start = 0  # the epochs a checkpoint in --ckpt-dir already trained: DCP writes a folder's .metadata last
if args.ckpt_dir:
    found = [int(d.removeprefix("epoch-")) for d in os.listdir(args.ckpt_dir) if d.startswith("epoch-")
             and os.path.exists(os.path.join(args.ckpt_dir, d, ".metadata"))] if os.path.isdir(args.ckpt_dir) else []
    decided = [max(found, default=0)]
    dist.broadcast_object_list(decided)  # rank 0's view of the folder, so every rank resumes from the same one
    start = decided[0]
if start:
    model_state, opt_state = get_state_dict(model, opt)  # this rank's shards, as DCP reads them
    state = {"model": model_state, "optim": opt_state}
    dcp.load(state, checkpoint_id=os.path.join(args.ckpt_dir, f"epoch-{start}"))  # every rank reads its part
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    if rank == 0:
        print(f"resumed from {args.ckpt_dir}/epoch-{start}", flush=True)

for epoch in range(start, args.epochs):
    sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
    total, steps = torch.zeros((), device=device), 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()  # FSDP2 reduce-scatters each layer's gradients: every rank keeps the mean of its shard
        opt.step()  # each rank updates its shard only
        total += loss.detach()
        steps += 1
    dist.all_reduce(total)  # the mean over every rank's batches, not rank 0's alone
    held_out = evaluate(model, val_loader, device)
    dist.all_reduce(held_out)  # sums, added over the ranks: the whole held-out set's loss and accuracy
    if rank == 0:  # one rank prints
        print(f"epoch {epoch}: loss {total.item() / world / steps:.4f} ({steps} steps of {world} x "
              f"{args.batch_size} images on {world} ranks); held-out loss {held_out[0] / held_out[2]:.4f}, "
              f"accuracy {held_out[1] / held_out[2]:.1%}", flush=True)
    if args.ckpt_dir:  # every rank writes its shards; written whole, or (no .metadata) never resumed from
        model_state, opt_state = get_state_dict(model, opt)
        dcp.save({"model": model_state, "optim": opt_state},
                 checkpoint_id=os.path.join(args.ckpt_dir, f"epoch-{epoch + 1}"))

# what sharding bought: each rank holds its part of the weights (a DTensor's to_local), not all of them
held = sum(p.to_local().numel() for p in model.parameters())
shares = [0] * world
dist.all_gather_object(shares, held)
if rank == 0:
    print(f"done: {world} ranks, {os.environ['LOCAL_WORLD_SIZE']} per node; parameters held per rank: {shares} "
          f"of {sum(p.numel() for p in model.parameters())}", flush=True)
# Tear down in order: every rank done, the model freed (its hooks keep the group alive), then the group.
# Left to the interpreter's exit, gloo's threads can abort ("terminate called without an active exception").
dist.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
