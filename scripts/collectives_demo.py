#!/usr/bin/env python
"""Every point-to-point operation and collective, shown on small tensors.

    torchrun --standalone --nproc-per-node=4 scripts/collectives_demo.py
    torchrun --standalone --nproc-per-node=4 scripts/collectives_demo.py --ops all_reduce scatter

Rank r starts with ``[10r, 10r+1, 10r+2]``-style tensors so you can follow
each value. Every rank's tensor is printed before and after each operation
(collected on rank 0, in rank order), and each result is checked against
what the operation must produce; a wrong result exits non-zero.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.results import emit_result

K = 3  # elements per tensor


def start(rank: int) -> torch.Tensor:
    return torch.arange(K, dtype=torch.float32) + 10 * rank


def fmt(t: torch.Tensor | list[torch.Tensor] | None) -> str:
    if t is None:
        return "-"
    if isinstance(t, list):
        return "[" + ", ".join(fmt(x) for x in t) + "]"
    return "[" + ", ".join(f"{v:g}" for v in t.tolist()) + "]"


def show(title: str, before: str, after: str, ok: bool) -> bool:
    rank = dist.get_rank()
    if rank == 0:
        print(f"\n== {title} ==", flush=True)
    cdist.print_ranks(f"rank {rank}: {before:>24s}  ->  {after}")
    flags = [None] * dist.get_world_size()
    dist.all_gather_object(flags, ok)
    return all(flags)


def demo(op: str, rank: int, n: int, device: torch.device) -> bool:
    x = start(rank).to(device)
    total = sum(start(r) for r in range(n)).to(device)
    if op == "send_recv":  # blocking: rank 0 sends to rank 1
        before = fmt(x)
        if rank == 0:
            dist.send(x, dst=1)
        elif rank == 1:
            dist.recv(x, src=0)
        ok = torch.equal(x, start(0).to(device)) if rank == 1 else torch.equal(x, start(rank).to(device))
        return show("send/recv: rank 0 -> rank 1", before, fmt(x), ok)
    if op == "isend_irecv":  # non-blocking ring shift: everyone sends right, receives from left
        before, out = fmt(x), torch.empty_like(x)
        # posted together as one batch: NCCL needs a ring's sends and receives grouped (posted one by one,
        # every rank's send can wait for a receive not yet posted); gloo accepts both
        ops = [dist.P2POp(dist.isend, x, (rank + 1) % n), dist.P2POp(dist.irecv, out, (rank - 1) % n)]
        for r in dist.batch_isend_irecv(ops):
            r.wait()
        return show("isend/irecv: shift one rank to the right", before, fmt(out),
                    torch.equal(out, start((rank - 1) % n).to(device)))
    if op == "broadcast":
        before = fmt(x)
        dist.broadcast(x, src=0)
        return show("broadcast from rank 0", before, fmt(x), torch.equal(x, start(0).to(device)))
    if op == "reduce":
        before = fmt(x)
        dist.reduce(x, dst=0, op=dist.ReduceOp.SUM)
        ok = torch.equal(x, total) if rank == 0 else True  # only the destination's result is defined
        return show("reduce (sum) to rank 0 (other ranks' buffers are scratch)", before,
                    fmt(x) if rank == 0 else "(undefined)", ok)
    if op == "all_reduce":
        before = fmt(x)
        dist.all_reduce(x, op=dist.ReduceOp.SUM)
        return show("all_reduce (sum)", before, fmt(x), torch.equal(x, total))
    if op == "all_gather":
        out = [torch.empty_like(x) for _ in range(n)]
        dist.all_gather(out, x)
        ok = all(torch.equal(out[r], start(r).to(device)) for r in range(n))
        return show("all_gather", fmt(x), fmt(out), ok)
    if op == "gather":
        out = [torch.empty_like(x) for _ in range(n)] if rank == 0 else None
        dist.gather(x, out, dst=0)
        ok = rank != 0 or all(torch.equal(out[r], start(r).to(device)) for r in range(n))
        return show("gather to rank 0", fmt(x), fmt(out), ok)
    if op == "scatter":
        pieces = [torch.full((K,), 100.0 + r, device=device) for r in range(n)] if rank == 0 else None
        out = torch.empty_like(x)
        dist.scatter(out, pieces, src=0)
        return show("scatter from rank 0 (piece r = [100+r]*3)", fmt(pieces) if rank == 0 else "-",
                    fmt(out), torch.equal(out, torch.full((K,), 100.0 + rank, device=device)))
    if op == "reduce_scatter":
        # every rank contributes n pieces; rank r receives the sum of everyone's piece r
        pieces = [start(rank).to(device) + r for r in range(n)]
        out = torch.empty_like(x)
        dist.reduce_scatter(out, pieces, op=dist.ReduceOp.SUM)
        expected = total + n * rank
        return show("reduce_scatter (sum): piece r of rank q = start(q) + r", fmt(pieces), fmt(out),
                    torch.equal(out, expected))
    if op == "barrier":
        time.sleep(0.2 * rank)  # ranks arrive one after another...
        arrived = time.time()
        dist.barrier()
        left = time.time()  # ...and leave together, once the last has arrived
        times = [None] * n
        dist.all_gather_object(times, (arrived, left))
        last_arrival = max(a for a, _ in times)
        ok = left >= last_arrival - 0.01
        return show("barrier (rank r arrives after 0.2*r s)", f"waited {left - arrived:.2f} s",
                    f"left {left - last_arrival:+.3f} s after the last arrival", ok)
    raise ValueError(op)


OPS = ["send_recv", "isend_irecv", "broadcast", "reduce", "all_reduce", "all_gather", "gather",
       "scatter", "reduce_scatter", "barrier"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ops", nargs="+", choices=OPS, default=OPS)
    add_device_flag(p)
    args = p.parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "collectives_demo.py")
        cdist.print0(f"{info.world_size} ranks, backend {dist.get_backend()}, device {device.type}")
        results = {op: demo(op, info.rank, info.world_size, device) for op in args.ops}
        cdist.print0()
        emit_result({"world_size": info.world_size, "checks": results})
        return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
