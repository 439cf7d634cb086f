#!/usr/bin/env python
"""plain_ddp.py written for Horovod: the lines that differ are the lesson (notebook 09 prints the diff).

    horovodrun -np 4 -H localhost:4 python scripts/plain_horovod.py --steps 20
    srun --mpi=pmix python scripts/plain_horovod.py --steps 20     # Slurm, a Horovod built with MPI

It needs a Horovod built against your torch: a site's module, or `pip install horovod` with its build
tools. The course does not run it: Horovod's last release, 0.28.1 (June 2023), does not build against
torch >= 2.1 from the package index (horovod issue 3996, fixed after that release).
"""

import argparse
import json
import sys

import torch
import horovod.torch as hvd

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--lr", type=float, default=0.1)
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

torch.manual_seed(0)  # the same initial weights on every rank
model = torch.nn.Linear(8, 1).to(device)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
# opt.step() waits for the gradients, all-reduced (averaged) as backward produces them
opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters())
hvd.broadcast_parameters(model.state_dict(), root_rank=0)  # rank 0's weights and optimizer state everywhere
hvd.broadcast_optimizer_state(opt, root_rank=0)
target = torch.arange(8, dtype=torch.float32, device=device)  # learn y = x . target
g = torch.Generator().manual_seed(rank)  # different data on every rank
losses = []
for _ in range(args.steps):
    x = torch.randn(32, 8, generator=g).to(device)
    loss = torch.nn.functional.mse_loss(model(x).squeeze(1), x @ target)
    opt.zero_grad()
    loss.backward()
    opt.step()
    losses.append(loss.item())

weights = model.weight.detach().reshape(1, -1)
gathered = hvd.allgather(weights)  # one row per rank
if rank == 0:
    print("PLAIN " + json.dumps({"world_size": world, "local_world_size": hvd.local_size(),
                                 "first_loss": losses[0], "last_loss": losses[-1],
                                 "ranks_agree": all(torch.equal(gathered[0], w) for w in gathered)}), flush=True)
hvd.shutdown()
