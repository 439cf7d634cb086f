#!/usr/bin/env python
"""Three ways to combine gradients, timed on the same workload:

* ``allreduce``: every rank computes, then one all-reduce (what DDP does);
* ``sync-ps``: rank 0 is a parameter server; workers send gradients, wait
  for all of them to be averaged, and receive the new parameters;
* ``async-ps``: the server applies each worker's gradient as it arrives and
  replies at once; nobody waits for the slowest worker, but gradients may be
  computed on parameters that are already a few updates old (staleness).

Compute is simulated with a fixed sleep per step so that only communication
and waiting differ between the schemes; ``--straggler`` makes the last rank
slower, as a busy node would be.

    torchrun --standalone --nproc-per-node=4 scripts/param_server.py --mib 16
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from course_utils import dist as cdist
from course_utils.results import emit_result


def compute(rank: int, world: int, ms: float, straggler: float) -> None:
    slow = straggler if rank == world - 1 else 1.0
    time.sleep(ms / 1000 * slow)


def run_allreduce(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    grad = torch.ones_like(params)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        compute(rank, world, ms, straggler)
        dist.all_reduce(grad)
        grad /= world
        params -= 1e-3 * grad
    elapsed = time.perf_counter() - start
    return {"updates": steps, "seconds": elapsed, "staleness": 0.0}


def run_sync_ps(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    buf = torch.empty_like(params)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        if rank == 0:
            total = torch.zeros_like(params)
            for w in range(1, world):
                dist.recv(buf, src=w)
                total += buf
            params -= 1e-3 * total / (world - 1)
            for w in range(1, world):
                dist.send(params, dst=w)
        else:
            compute(rank, world, ms, straggler)
            dist.send(torch.ones_like(params), dst=0)
            dist.recv(params, src=0)
    elapsed = time.perf_counter() - start
    return {"updates": steps, "seconds": elapsed, "staleness": 0.0}


def run_async_ps(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    """Each message carries the parameter version it was computed from in its last element."""
    rank, world = dist.get_rank(), dist.get_world_size()
    msg = torch.empty(params.numel() + 1, dtype=params.dtype)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        version, stale = 0, []
        remaining = {w: steps for w in range(1, world)}
        while any(remaining.values()):
            sender = dist.recv(msg)  # from whichever worker is ready first
            stale.append(version - int(msg[-1].item()))
            params -= 1e-3 * msg[:-1]
            version += 1
            remaining[sender] -= 1
            msg[:-1], msg[-1] = params, version
            dist.send(msg, dst=sender)
        elapsed = time.perf_counter() - start
        return {"updates": version, "seconds": elapsed, "staleness": sum(stale) / len(stale)}
    version = 0
    for _ in range(steps):
        compute(rank, world, ms, straggler)
        msg[:-1], msg[-1] = 1.0, version
        dist.send(msg, dst=0)
        dist.recv(msg, src=0)
        params.copy_(msg[:-1])
        version = int(msg[-1].item())
    elapsed = time.perf_counter() - start
    return {"updates": steps, "seconds": elapsed, "staleness": float("nan")}


SCHEMES = {"allreduce": run_allreduce, "sync-ps": run_sync_ps, "async-ps": run_async_ps}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=float, default=4.0, help="gradient size in MiB (float32)")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--compute-ms", type=float, default=20.0, help="simulated compute per step")
    p.add_argument("--straggler", type=float, default=1.0, help="last rank's compute is this many times slower")
    p.add_argument("--schemes", nargs="+", choices=list(SCHEMES), default=list(SCHEMES))
    args = p.parse_args()
    if args.mib <= 0 or args.steps < 1 or args.compute_ms < 0 or args.straggler < 1:
        p.error("need --mib > 0, --steps >= 1, --compute-ms >= 0, --straggler >= 1")
    with cdist.session("cpu") as (info, device):  # point-to-point on CPU tensors: gloo everywhere
        n = info.world_size
        cdist.require_processes(3, "param_server.py", " (a server and two workers)")
        numel = int(args.mib * 2**20 / 4)
        nbytes = numel * 4
        cdist.print0(f"{n} ranks; gradient {args.mib:g} MiB; compute {args.compute_ms:g} ms/step; "
                     f"straggler x{args.straggler:g}")
        results = {}
        for name in args.schemes:
            out = SCHEMES[name](torch.zeros(numel), args.steps, args.compute_ms, args.straggler)
            gathered = [None] * n
            dist.all_gather_object(gathered, out)
            workers = gathered if name == "allreduce" else gathered[1:]
            seconds = max(w["seconds"] for w in workers)
            updates = args.steps if name != "async-ps" else gathered[0]["updates"]
            # bytes through the busiest rank per round of updates
            if name == "allreduce":
                busiest = 2 * (n - 1) / n * nbytes
            else:
                busiest = 2 * (n - 1) * nbytes  # the server receives and sends one copy per worker
            results[name] = {
                "ms_per_step": 1e3 * seconds / args.steps,
                "updates_per_s": updates / seconds,
                "samples_per_s": (n if name == "allreduce" else n - 1) * args.steps / seconds,
                "busiest_rank_mib_per_step": busiest / 2**20,
                "mean_staleness": gathered[0]["staleness"],
            }
        cdist.print0(f"\n{'scheme':10s} {'ms/step':>8s} {'updates/s':>10s} {'grads/s':>8s} "
                     f"{'busiest rank MiB/round':>23s} {'staleness':>9s}")
        for name, r in results.items():
            cdist.print0(f"{name:10s} {r['ms_per_step']:8.1f} {r['updates_per_s']:10.1f} {r['samples_per_s']:8.1f} "
                         f"{r['busiest_rank_mib_per_step']:23.1f} {r['mean_staleness']:9.2f}")
        emit_result({"world_size": n, "mib": args.mib, "schemes": results})
        return 0


if __name__ == "__main__":
    sys.exit(main())
