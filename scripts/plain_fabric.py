#!/usr/bin/env python
"""plain_ddp.py converted to Lightning Fabric, as a researcher converts it: no course_utils, and the lines that
differ from plain_ddp.py are the lesson (notebook 06 shows the diff). Fabric reads what torchrun sets, joins the
group, puts the model and the batches on the rank's device, wraps DDP and runs the precision; the loop stays yours.

One process per GPU, each seeing all the node's GPUs: torchrun, or srun with slurm/lib/torch_env.sh and no
--gpus-per-task (the course's train_fabric.py also takes that binding, through course_utils.lit.plan_launch).

    torchrun --standalone --nproc-per-node=2 scripts/plain_fabric.py --epochs 3
"""

import argparse
import gc
import os

import lightning as L
import torch
import torch.distributed as dist
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

use_gpu = torch.cuda.is_available()  # the same answer on every rank: all NCCL, or all gloo
# mixed precision where the GPU has it: bf16 from compute capability 8 (A100, H100), fp16 with loss scaling before
precision = "32-true"
if use_gpu:
    # this rank's own GPU (its local rank), not GPU 0, before Fabric sets it
    precision = "bf16-mixed" if torch.cuda.get_device_capability(int(os.environ["LOCAL_RANK"]))[0] >= 8 else "16-mixed"
per_node = int(os.environ["LOCAL_WORLD_SIZE"])  # set by torchrun, or by slurm/lib/torch_env.sh under srun
fabric = L.Fabric(accelerator="cuda" if use_gpu else "cpu", devices=per_node,
                  num_nodes=int(os.environ["WORLD_SIZE"]) // per_node, strategy="ddp", precision=precision)
fabric.launch()  # this rank's GPU set, then the group joined (NCCL or gloo), from the launcher's variables
rank, world = fabric.global_rank, fabric.world_size

torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
model = build_model()
opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
model, opt = fabric.setup(model, opt)  # on the rank's device, wrapped in DDP, run in `precision`
dataset = get_dataset(args.n_train, args.data)
sampler = DistributedSampler(dataset, shuffle=True, seed=0, drop_last=True)  # a disjoint 1/world of it per rank
loader = DataLoader(dataset, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                    num_workers=args.workers, pin_memory=use_gpu)
val_set = get_dataset(args.n_val, args.data, train=False)  # each rank scores its 1/world: no shuffle, no drop
val_loader = DataLoader(val_set, batch_size=256, sampler=DistributedSampler(val_set, shuffle=False))
loader, val_loader = fabric.setup_dataloaders(loader, val_loader, use_distributed_sampler=False)  # batches on device

for epoch in range(args.epochs):
    sampler.set_epoch(epoch)  # kept from plain_ddp.py: Fabric's loader sets it too, to how often it was iterated
    total, steps = torch.zeros((), device=fabric.device), 0
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)  # in `precision`: Fabric autocasts the forward
        opt.zero_grad(set_to_none=True)
        fabric.backward(loss)  # DDP all-reduces the gradients during backward; fp16 scales the loss
        opt.step()
        total += loss.detach()
        steps += 1
    total = fabric.all_reduce(total, reduce_op="sum")  # the mean over every rank's batches, not rank 0's alone
    held_out = evaluate(model, val_loader, fabric.device)
    held_out = fabric.all_reduce(held_out, reduce_op="sum")  # the whole held-out set's loss and accuracy
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
fabric.barrier()
del model, opt
gc.collect()
dist.destroy_process_group()
