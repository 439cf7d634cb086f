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
slower, as a busy node would be. The schemes are compared on equal terms:
gradients applied per second (the asynchronous server stops after as many
gradients as the synchronous one applies, from whichever workers sent them),
and the bytes the busiest rank sent and received, counted as they moved.

    torchrun --standalone --nproc-per-node=4 scripts/param_server.py --mib 16
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.collectives import ring_all_reduce
from course_utils.results import emit_result


def compute(rank: int, world: int, ms: float, straggler: float) -> None:
    slow = straggler if rank == world - 1 else 1.0
    time.sleep(ms / 1000 * slow)


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def run_allreduce(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    """Every rank computes a gradient each step; the hand-written ring averages them (and counts its bytes)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    grad, sent = torch.ones_like(params), []
    dist.barrier()
    start = time.perf_counter()
    for _ in range(steps):
        compute(rank, world, ms, straggler)
        ring_all_reduce(grad, sent)
        grad /= world
        params -= 1e-3 * grad
    # the ring receives exactly as much as it sends
    return {"gradients": steps, "seconds": time.perf_counter() - start, "bytes": 2 * sum(sent), "staleness": 0.0}


def run_sync_ps(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    """Each round, the server waits for every worker's gradient, averages, and sends the parameters back."""
    rank, world = dist.get_rank(), dist.get_world_size()
    buf, moved, gradients = torch.empty_like(params), 0, 0
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
            moved += 2 * (world - 1) * nbytes(params)
        else:
            compute(rank, world, ms, straggler)
            dist.send(torch.ones_like(params), dst=0)
            dist.recv(params, src=0)
            moved += 2 * nbytes(params)
            gradients += 1
    return {"gradients": gradients, "seconds": time.perf_counter() - start, "bytes": moved, "staleness": 0.0}


def run_async_ps(params: torch.Tensor, steps: int, ms: float, straggler: float) -> dict:
    """The server applies each gradient as it arrives until it has applied as many as the synchronous
    server does, (world - 1) x steps, from whichever workers sent them; it then tells each worker to stop.
    Each message carries the parameter version it was computed from in its last element (-1: stop)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    msg = torch.empty(params.numel() + 1, dtype=params.dtype)
    dist.barrier()
    start = time.perf_counter()
    if rank == 0:
        version, stale, moved, active = 0, [], 0, set(range(1, world))
        while active:
            sender = dist.recv(msg)  # from whichever worker is ready first
            moved += nbytes(msg)
            if version < (world - 1) * steps:
                stale.append(version - int(msg[-1].item()))
                params -= 1e-3 * msg[:-1]
                version += 1
                if version == (world - 1) * steps:
                    elapsed = time.perf_counter() - start
                msg[:-1], msg[-1] = params, version
            else:
                msg[-1] = -1
                active.discard(sender)
            dist.send(msg, dst=sender)
            moved += nbytes(msg)
        return {"gradients": 0, "seconds": elapsed, "bytes": moved, "staleness": sum(stale) / len(stale)}
    version, gradients, moved = 0, 0, 0
    while version >= 0:
        compute(rank, world, ms, straggler)
        msg[:-1], msg[-1] = 1.0, version
        dist.send(msg, dst=0)
        dist.recv(msg, src=0)
        moved += 2 * nbytes(msg)
        version = int(msg[-1].item())
        if version >= 0:
            params.copy_(msg[:-1])
            gradients += 1
    return {"gradients": gradients, "seconds": time.perf_counter() - start, "bytes": moved, "staleness": float("nan")}


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
        cdist.print0(f"{n} ranks; gradient {args.mib:g} MiB; compute {args.compute_ms:g} ms/step; "
                     f"straggler x{args.straggler:g}")
        results = {}
        for name in args.schemes:
            out = SCHEMES[name](torch.zeros(numel), args.steps, args.compute_ms, args.straggler)
            gathered: list = [None] * n
            dist.all_gather_object(gathered, out)
            workers = gathered if name == "allreduce" else gathered[1:]
            applied = sum(w["gradients"] for w in workers)
            seconds = gathered[0]["seconds"] if name == "async-ps" else max(g["seconds"] for g in gathered)
            rounds = applied / len(workers)  # a round: one gradient from every worker
            results[name] = {
                "seconds": seconds,
                "gradients": applied,
                "grads_per_s": applied / seconds,
                "gradients_per_worker": [w["gradients"] for w in workers],
                # counted, not computed: bytes sent and received by the busiest rank, per round
                "busiest_rank_mib_per_round": max(g["bytes"] for g in gathered) / rounds / 2**20,
                "mean_staleness": gathered[0]["staleness"],
            }
        cdist.print0(f"\n{'scheme':10s} {'gradients':>9s} {'seconds':>8s} {'grads/s':>8s} "
                     f"{'busiest rank MiB/round':>23s} {'staleness':>9s}  gradients per worker")
        for name, r in results.items():
            cdist.print0(f"{name:10s} {r['gradients']:9d} {r['seconds']:8.2f} {r['grads_per_s']:8.1f} "
                         f"{r['busiest_rank_mib_per_round']:23.1f} {r['mean_staleness']:9.2f}  "
                         f"{r['gradients_per_worker']}")
        emit_result({"world_size": n, "mib": args.mib, "schemes": results})
        return 0


if __name__ == "__main__":
    sys.exit(main())
