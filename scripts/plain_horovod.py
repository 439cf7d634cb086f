#!/usr/bin/env python
"""plain_ddp.py written for Horovod: the lines that differ are the lesson (notebook 09 prints the diff).

    horovodrun -np 4 -H localhost:4 python scripts/plain_horovod.py --epochs 3
    srun --mpi=pmix python scripts/plain_horovod.py --epochs 3     # Slurm, a Horovod built with MPI

It needs a Horovod built against your torch: a site's module, or `pip install horovod` with its build
tools. The course does not run it: Horovod's last release, 0.28.1 (June 2023), does not build against
torch >= 2.1 from the package index (horovod issue 3996, fixed after that release).
"""

import argparse
import sys

import torch
import horovod.torch as hvd
from torch.utils.data import DataLoader, DistributedSampler

from plain_parts import build_model, get_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--epochs", type=int, default=3)
parser.add_argument("--batch-size", type=int, default=64, help="per rank: a step averages ranks x this")
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--n-train", type=int, default=4096, help="images of the offline data set")
parser.add_argument("--data", default=None, help="a folder with torchvision's MNIST, instead of the offline data")
parser.add_argument("--workers", type=int, default=2, help="DataLoader worker processes per rank")
args = parser.parse_args()

hvd.init()  # rank, size and local rank from horovodrun, mpirun or srun
local_rank = hvd.local_rank()
use_gpu = torch.cuda.is_available()  # the same answer on every rank: all NCCL, or all gloo
if use_gpu and local_rank >= torch.cuda.device_count():  # NCCL never shares a GPU between ranks
    sys.exit(f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} GPU(s): "
             "start one process per GPU (horovodrun -np, srun --ntasks-per-node)")
device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
if use_gpu:  # this rank's GPU, before any allocation: every later allocation uses it, not GPU 0
    torch.cuda.set_device(device)
rank, world = hvd.rank(), hvd.size()
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100), fp16 with loss scaling before
amp_dtype = None
if device.type == "cuda":
    amp_dtype = torch.bfloat16 if torch.cuda.get_device_capability(device)[0] >= 8 else torch.float16
scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)

torch.manual_seed(0)  # the same initial weights on every rank
model = build_model().to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
# opt.step() waits for the gradients, all-reduced (averaged) as backward produces them
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # rank 0's weights and optimizer state everywhere
hvd.broadcast_optimizer_state(opt, root_rank=0)
dataset = get_dataset(args.n_train, args.data)
# a disjoint 1/world of it per rank
sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=0, drop_last=True)
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    num_workers=args.workers, pin_memory=device.type == "cuda")

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
    total, steps = torch.zeros((), device=device), 0
    for x, y in loader:
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # Horovod all-reduces the gradients during backward
        opt.synchronize()  # the averaged gradients, before the scaler reads them for infs
        with opt.skip_synchronize():
            scaler.step(opt)
        scaler.update()
        total += loss.detach()
        steps += 1
    total = hvd.allreduce(total, op=hvd.Sum)  # the mean over every rank's batches, not rank 0's alone
    if rank == 0:  # one rank prints
        print(f"epoch {epoch}: loss {total.item() / world / steps:.4f} ({steps} steps of {world} x "
              f"{args.batch_size} images on {world} ranks)", flush=True)

# a check worth keeping while you convert a script: DDP keeps every rank's weights identical
weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
gathered = hvd.allgather(weights.reshape(1, -1))  # one row per rank
if rank == 0:
    print(f"done: {world} ranks, {hvd.local_size()} per node; weights identical on every rank: "
          f"{all(torch.equal(gathered[0], w) for w in gathered)}", flush=True)
hvd.shutdown()
