#!/usr/bin/env python
"""Data-parallel training with one fault put in on purpose, to diagnose (notebook 11).

A small model whose gradients are averaged by hand (one all_reduce a step, as notebook 02 built it), and at
most one fault:

  --stuck-rank R --stuck-step S     rank R stops before step S's all_reduce for --stuck-s seconds (a file
                                    read that hangs, a dataloader worker that died); the others wait for it
  --mismatch-rank R --mismatch-step S
                                    rank R all-reduces a tensor of another shape at step S (a branch only that
                                    rank takes: "if rank == 0: log the global loss")
  --slow-rank R --slow-ms MS        rank R computes MS milliseconds longer every step (a straggler)
  --save-step S --save-s SECONDS --save-mode MODE
                                    rank 0 alone writes a checkpoint after step S, which takes SECONDS more (a
                                    sleep stands for a slow shared file system). MODE: "plain", the others go on
                                    to step S+1; "barrier", every rank waits in a barrier after the save;
                                    "background", rank 0 copies the state and writes it in a thread (as
                                    torch.distributed.checkpoint.async_save does), so nobody waits for the write

With --debug-port P, rank 0 serves torch's debug server on port P: every rank's Python stacks and flight record
over HTTP (http://<rank 0's node>:P/stacks), while the job runs.

Every rank keeps the flight recorder torch.distributed keeps (its last collectives: which, of what shape, from
which line; $TORCH_FR_BUFFER_SIZE entries, 0 turns it off). When a collective fails, or the launcher stops a
rank (SIGTERM), the rank writes that record to --dump-dir/rank_<r>, as NCCL's watchdog does on a timeout, and
says so in one line. Rank 0 prints each rank's step times as a RESULT line when the run ends well.

    COURSE_DIST_TIMEOUT=5 torchrun --standalone --nproc-per-node=2 scripts/faulty_ddp.py \\
        --stuck-rank 1 --stuck-step 3 --dump-dir runs/11/hang
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.errors import first_line
from course_utils.results import emit_result


def dump_flight_record(dump_dir: Path, rank: int, why: str) -> None:
    """This rank's flight record, as torch.distributed keeps it, written where the others' go."""
    nccl = "nccl" in dist.get_backend_config().lower()
    # private: torch has no public call for a dump on demand (its own tests read the buffer this way)
    c10d = torch._C._distributed_c10d
    record = c10d._dump_nccl_trace() if nccl else c10d._dump_fr_trace()  # pickled: what torch's own tools read
    dump_dir.mkdir(parents=True, exist_ok=True)
    (dump_dir / f"rank_{rank}").write_bytes(record)
    print(f"rank {rank}: {why}; flight record written to {dump_dir / f'rank_{rank}'}", flush=True)


def serve_debug_pages(port: int, rank: int) -> None:
    """torch's debug server: each rank answers for itself, rank 0 also serves the pages that gather them all."""
    try:
        from torch.distributed.debug import start_debug_server
    except ImportError as exc:
        print(f"rank {rank}: torch {torch.__version__} has no debug server ({exc}); py-spy still works", flush=True)
        return
    start_debug_server(port=port, start_method="spawn")  # spawn: no fork of a process that may hold CUDA


def save_on_rank_0(model: torch.nn.Module, path: Path, extra_s: float, mode: str, rank: int):
    """Rank 0 writes the checkpoint (``extra_s`` more: a slow file system); the thread writing it, if any."""
    def write(state: dict) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(state, path)
        time.sleep(extra_s)  # a shared file system under load
        print(f"rank {rank}: checkpoint written ({mode})", flush=True)

    writer = None
    if rank == 0 and mode == "background":  # copy now, write while training goes on
        state = {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}
        writer = threading.Thread(target=write, args=(state,))
        writer.start()
    elif rank == 0:
        write(model.state_dict())
    if mode == "barrier":
        dist.barrier()  # the others wait here for the save, under the same timeout as any collective
    return writer


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_flag(p)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--stuck-rank", type=int)
    p.add_argument("--stuck-step", type=int, default=3)
    p.add_argument("--stuck-s", type=float, default=30.0, help="how long the stuck rank stays stuck")
    p.add_argument("--mismatch-rank", type=int)
    p.add_argument("--mismatch-step", type=int, default=3)
    p.add_argument("--slow-rank", type=int)
    p.add_argument("--slow-ms", type=float, default=0.0)
    p.add_argument("--save-step", type=int)
    p.add_argument("--save-s", type=float, default=0.0, help="how much longer the save takes than the write")
    p.add_argument("--save-mode", choices=("plain", "barrier", "background"), default="plain")
    p.add_argument("--debug-port", type=int, help="rank 0 serves torch's debug server on this port")
    p.add_argument("--dump-dir", type=Path, default=Path("flight-records"))
    args = p.parse_args()

    info, device = cdist.init_distributed(args.device)
    cdist.require_processes(2, "faulty_ddp.py")
    rank, world = info.rank, info.world_size
    def stopped(signum, frame):  # the launcher stops the other ranks when one fails: write the record, and the line
        where = f"{Path(frame.f_code.co_filename).name}:{frame.f_lineno}" if frame else "?"
        dump_flight_record(args.dump_dir, rank, f"stopped by the launcher at {where}")
        os._exit(143)

    signal.signal(signal.SIGTERM, stopped)
    if args.debug_port:
        serve_debug_pages(args.debug_port, rank)

    torch.manual_seed(0)  # the same weights everywhere
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(rank)  # each rank its own data
    compute_s, allreduce_s = [], []
    writer = None
    try:
        for step in range(1, args.steps + 1):
            start = time.perf_counter()
            x, y = torch.randn(64, 32, generator=g).to(device), torch.randint(0, 4, (64,), generator=g).to(device)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            if rank == args.slow_rank:
                time.sleep(args.slow_ms / 1000)  # the straggler's extra work
            if rank == args.stuck_rank and step == args.stuck_step:
                print(f"rank {rank}: stuck before step {step}'s all_reduce", flush=True)
                time.sleep(args.stuck_s)
            grads = torch.cat([q.grad.reshape(-1) for q in model.parameters()])
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # the compute is done: what follows is waiting and sending
            mid = time.perf_counter()
            if rank == args.mismatch_rank and step == args.mismatch_step:
                dist.all_reduce(loss.detach().reshape(1))  # the bug: this rank alone reduces its loss
            dist.all_reduce(grads)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            end = time.perf_counter()
            torch.nn.utils.vector_to_parameters(grads / world, [q.grad for q in model.parameters()])
            opt.step()
            compute_s.append(mid - start)
            allreduce_s.append(end - mid)
            if step == args.save_step:
                writer = save_on_rank_0(model, args.dump_dir / "checkpoint.pt", args.save_s, args.save_mode, rank)
    except Exception as exc:  # gloo raises the timeout or the mismatch here; NCCL's watchdog ends the process
        dump_flight_record(args.dump_dir, rank, f"step {step} failed: {first_line(exc, with_type=True)}")
        return 1

    times = [None] * world
    dist.all_gather_object(times, {"rank": rank, "compute_s": compute_s, "allreduce_s": allreduce_s})
    emit_result({"world_size": world, "device": str(device), "steps": args.steps, "ranks": times,
                 "slow_rank": args.slow_rank, "slow_ms": args.slow_ms})
    if writer is not None:
        writer.join()  # the file is complete before this rank ends; no collective waits for it
    return 0


if __name__ == "__main__":
    sys.exit(main())
