#!/usr/bin/env python
"""plain_single.py made distributed with DDP, as a researcher writes it: no course_utils, it reads what torchrun
sets. The lines that differ from plain_single.py are the lesson (notebook 03 shows the diff).

Every slurm/ pattern runs it unchanged (TRAIN_SCRIPT=scripts/plain_ddp.py): under srun,
slurm/lib/torch_env.sh sets the same variables torchrun does.

    torchrun --standalone --nproc-per-node=2 scripts/plain_ddp.py --epochs 3
"""

import argparse
import gc
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
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
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100), fp16 with loss scaling before
amp_dtype = None
if device.type == "cuda":
    amp_dtype = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
model = DDP(build_model().to(device), device_ids=[local_rank] if use_gpu else None)
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
dataset = get_dataset(args.n_train, args.data)
sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)  # a disjoint 1/world of it per rank
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    num_workers=args.workers, pin_memory=device.type == "cuda")
val_set = get_dataset(args.n_val, args.data, train=False)  # each rank scores its 1/world: no shuffle, no drop
val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
    total, steps = torch.zeros((), device=device), 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the gradients during backward
        scaler.step(opt)
        scaler.update()
        total += loss.detach()
        steps += 1
    dist.all_reduce(total)  # the mean over every rank's batches, not rank 0's alone
    held_out = evaluate(model, val_loader, device)
    dist.all_reduce(held_out)  # sums, added over the ranks: the whole held-out set's loss and accuracy
    if rank == 0:  # one rank prints
        print(f"epoch {epoch}: loss {total.item() / world / steps:.4f} ({steps} steps of {world} x "
              f"{args.batch_size} images on {world} ranks); held-out loss {held_out[0] / held_out[2]:.4f}, "
              f"accuracy {held_out[1] / held_out[2]:.1%}", flush=True)

# a check worth keeping while you convert a script: DDP keeps every rank's weights identical
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = [torch.empty_like(weights) for _ in range(world)]
dist.all_gather(gathered, weights)
if rank == 0:
    print(f"done: {world} ranks, {os.environ['LOCAL_WORLD_SIZE']} per node; weights identical on every rank: "
          f"{all(torch.equal(gathered[0], w) for w in gathered)}", flush=True)
# Tear down in order: every rank done, DDP freed (its reference cycles keep the group alive), then the group.
# Left to the interpreter's exit, gloo's threads can abort ("terminate called without an active exception").
dist.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
