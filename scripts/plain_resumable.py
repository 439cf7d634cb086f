#!/usr/bin/env python
"""plain_ddp.py made to survive a kill and a time limit: rank 0 saves the whole state atomically, every start
resumes from it, and a SIGUSR1 (Slurm's warning before the time limit) stops every rank at the same step with a
checkpoint. The lines that differ from plain_ddp.py are the lesson (notebook 05 shows the diff).

    torchrun --standalone --nproc-per-node=2 --max-restarts=1 scripts/plain_resumable.py --epochs 3
    sbatch slurm/ddp_requeue_one_file.sbatch     # requeued by Slurm before its time limit, resumed each start
"""

import argparse
import gc
import itertools
import os
import signal
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
parser.add_argument("--ckpt", default=os.path.join(os.environ.get("RUN_DIR", "runs/plain_resumable"), "last.pt"),
                    help="the checkpoint: written every --save-every steps, read at start (the same path every start)")
parser.add_argument("--save-every", type=int, default=20, help="optimiser steps between checkpoints")
args = parser.parse_args()

stop_requested = False


def request_stop(signum, frame):  # only note it: the training loop stops every rank at the same step
    global stop_requested
    stop_requested = True


# Slurm's warning (#SBATCH --signal=B:USR1@120, passed on by the job), handled from the start: unhandled, it kills
signal.signal(signal.SIGUSR1, request_stop)

local_rank = int(os.environ["LOCAL_RANK"])  # set by torchrun, or by slurm/lib/torch_env.sh under srun
use_gpu = torch.cuda.is_available()  # the same answer on every rank: all NCCL, or all gloo
if use_gpu and local_rank >= torch.cuda.device_count():  # NCCL never shares a GPU between ranks
    sys.exit(f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} GPU(s): "
             "start one process per GPU (torchrun --nproc-per-node, srun --ntasks-per-node)")
device = torch.device("cuda", local_rank) if use_gpu else torch.device("cpu")
if use_gpu:  # this rank's GPU, before the group exists: NCCL and every later allocation use it, not GPU 0
    torch.cuda.set_device(device)
# Meeting the other ranks. For one attempt plain_ddp.py's init_process_group(backend) is enough. Under torchrun
# --max-restarts every attempt meets in one store, its agent's, which still holds the failed attempt's addresses:
# so each attempt meets under a prefix of its own (its restart count). Under srun alone rank 0 serves the store.
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
agent_serves = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, rank == 0 and not agent_serves)
store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
dist.init_process_group("nccl" if use_gpu else "gloo", store=store, rank=rank, world_size=world,
                        device_id=device if use_gpu else None)
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



def save(epoch: int, batch: int) -> None:
    """Rank 0 writes the whole state to a temporary file, fsyncs it, then renames it over the last one: a rename
    is atomic, so a job killed mid-write keeps the previous checkpoint."""
    if rank != 0:
        return
    if batch == len(loader):  # a finished epoch is the start of the next
        epoch, batch = epoch + 1, 0
    state = {"model": model.module.state_dict(), "optimizer": opt.state_dict(), "scaler": scaler.state_dict(),
             "rng": torch.get_rng_state(), "epoch": epoch, "batch": batch}  # batch: steps done in that epoch
    # yours may need more: an LR scheduler's state_dict(), Python's or NumPy's RNG if augmentations draw from them
    if use_gpu:
        state["cuda_rng"] = torch.cuda.get_rng_state(device)
    os.makedirs(os.path.dirname(os.path.abspath(args.ckpt)), exist_ok=True)
    with open(args.ckpt + ".tmp", "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(args.ckpt + ".tmp", args.ckpt)


start_epoch, start_batch = 0, 0
if os.path.exists(args.ckpt):  # a restart (torchrun --max-restarts) or a requeued job: go on from the checkpoint
    state = torch.load(args.ckpt, map_location=device)  # every rank reads it onto its own device
    model.module.load_state_dict(state["model"])
    opt.load_state_dict(state["optimizer"])
    scaler.load_state_dict(state["scaler"])
    torch.set_rng_state(state["rng"].cpu())  # RNG states live on the CPU, whatever map_location moved
    if use_gpu and "cuda_rng" in state:
        torch.cuda.set_rng_state(state["cuda_rng"].cpu(), device)
    start_epoch, start_batch = state["epoch"], state["batch"]
    if rank == 0:
        print(f"resumed from {args.ckpt}: epoch {start_epoch}, after batch {start_batch}", flush=True)

for epoch in range(start_epoch, args.epochs):
    sampler.set_epoch(epoch)  # a new shuffle each epoch; without it every epoch repeats the first one's order
    total, steps, stop = torch.zeros((), device=device), 0, torch.zeros((), dtype=torch.int64, device=device)
    skip = start_batch if epoch == start_epoch else 0  # batches this epoch trained before the restart
    for batch, (x, y) in enumerate(itertools.islice(loader, skip, None), start=skip):  # (skipped ones are read)
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()  # DDP all-reduces the gradients during backward
        scaler.step(opt)
        scaler.update()
        total += loss.detach()
        steps += 1
        if (batch + 1) % args.save_every == 0:
            save(epoch, batch + 1)
        # did any rank get the signal? Every rank must stop at the same step, or the others wait in the next all-reduce
        stop = torch.tensor(int(stop_requested), device=device)
        dist.all_reduce(stop, op=dist.ReduceOp.MAX)
        if stop.item():
            save(epoch, batch + 1)
            break
    if stop.item():  # the job's batch shell requeues it; the next start resumes from this checkpoint
        if rank == 0:
            print(f"stopped on SIGUSR1 in epoch {epoch}, after batch {batch + 1}; saved {args.ckpt}", flush=True)
        break
    dist.all_reduce(total)  # the mean over every rank's batches, not rank 0's alone
    held_out = evaluate(model, val_loader, device)
    dist.all_reduce(held_out)  # sums, added over the ranks: the whole held-out set's loss and accuracy
    if rank == 0:  # one rank prints
        print(f"epoch {epoch}: loss {total.item() / world / steps:.4f} ({steps} steps of {world} x "
              f"{args.batch_size} images on {world} ranks); held-out loss {held_out[0] / held_out[2]:.4f}, "
              f"accuracy {held_out[1] / held_out[2]:.1%}", flush=True)
    save(epoch + 1, 0)

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
