#!/usr/bin/env python
"""The DDP script a researcher writes, with no course_utils: it reads what torchrun sets.

Every slurm/ pattern must run it unchanged (TRAIN_SCRIPT=scripts/plain_ddp.py): under srun,
slurm/lib/torch_env.sh sets the same variables torchrun does.

    torchrun --standalone --nproc-per-node=2 scripts/plain_ddp.py --steps 20
"""

import argparse
import gc
import json
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=50)
parser.add_argument("--lr", type=float, default=0.1)
args = parser.parse_args()

local_rank = int(os.environ["LOCAL_RANK"])
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

torch.manual_seed(0)  # the same initial weights on every rank
model = DDP(torch.nn.Linear(8, 1).to(device), device_ids=[local_rank] if use_gpu else None)
opt = torch.optim.SGD(model.parameters(), lr=args.lr)
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

weights = model.module.weight.detach().reshape(-1)
gathered = [torch.empty_like(weights) for _ in range(world)]
dist.all_gather(gathered, weights)
if rank == 0:
    print("PLAIN " + json.dumps({"world_size": world, "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
                                 "first_loss": losses[0], "last_loss": losses[-1],
                                 "ranks_agree": all(torch.equal(gathered[0], w) for w in gathered)}), flush=True)
# DDP holds the process group inside reference cycles: free it before the interpreter exits,
# or gloo's threads may be torn down then and abort ("terminate called without an active exception").
dist.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
