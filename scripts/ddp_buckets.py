#!/usr/bin/env python
"""What ``bucket_cap_mb`` and ``gradient_as_bucket_view`` change, measured.

DDP does not all-reduce each gradient on its own: it packs gradients into
buckets of ``bucket_cap_mb`` and launches one all-reduce per bucket as soon as
the bucket is full during ``backward()``, overlapping communication with the
rest of the backward pass. Small buckets: many small (latency-bound)
all-reduces. One huge bucket: no overlap. A communication hook counts the
all-reduces; each configuration's backward step is timed.

    torchrun --standalone --nproc-per-node=2 scripts/ddp_buckets.py --model resnet18
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.models import MODELS, build_model, count_parameters
from course_utils.results import emit_result


def measure(model_name: str, device: torch.device, cap_mb: float, as_view: bool, batch: int,
            steps: int, accum: int = 1, no_sync: bool = True) -> dict:
    torch.manual_seed(0)
    model = DDP(build_model(model_name).to(device), device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=cap_mb, gradient_as_bucket_view=as_view)
    calls = {"n": 0}

    def counting_hook(state, bucket):
        calls["n"] += 1
        return default_hooks.allreduce_hook(state, bucket)

    model.register_comm_hook(dist.group.WORLD, counting_hook)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(batch, 3, 32, 32, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    times = []
    for step in range(steps + 1):  # step 0 builds DDP's buckets: not counted
        if step == 1:
            calls["n"] = 0
        start = time.perf_counter()
        for micro in range(accum):
            skip = no_sync and micro < accum - 1
            ctx = model.no_sync() if skip else torch.enable_grad()
            with ctx:
                torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=not as_view)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    t = torch.tensor([sum(times) / len(times)], device=device)  # NCCL: collectives on the rank's GPU
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {"bucket_cap_mb": cap_mb, "grad_as_bucket_view": as_view, "accum": accum, "no_sync": no_sync,
            "allreduces_per_step": calls["n"] / steps, "ms_per_step": 1e3 * float(t)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="resnet18")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--caps", type=float, nargs="+", default=[1.0, 25.0, 100.0])
    add_device_flag(p)
    args = p.parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "ddp_buckets.py")
        mib = count_parameters(build_model(args.model)) * 4 / 2**20
        cdist.print0(f"{args.model}: {mib:.1f} MiB of fp32 gradients; {info.world_size} ranks, {dist.get_backend()}")
        rows = [measure(args.model, device, cap, False, args.batch_size, args.steps) for cap in args.caps]
        rows.append(measure(args.model, device, 25.0, True, args.batch_size, args.steps))
        # accumulation over 4 micro-batches, with and without no_sync
        rows.append(measure(args.model, device, 25.0, False, args.batch_size, args.steps, accum=4, no_sync=True))
        rows.append(measure(args.model, device, 25.0, False, args.batch_size, args.steps, accum=4, no_sync=False))
        cdist.print0(f"\n{'bucket MB':>9s} {'as view':>7s} {'accum':>5s} {'no_sync':>7s} "
                     f"{'all-reduces/step':>16s} {'ms/step':>8s}")
        for r in rows:
            cdist.print0(f"{r['bucket_cap_mb']:9g} {str(r['grad_as_bucket_view']):>7s} {r['accum']:5d} "
                         f"{str(r['no_sync']):>7s} {r['allreduces_per_step']:16.1f} {r['ms_per_step']:8.1f}")
        emit_result({"world_size": info.world_size, "grad_mib": mib, "rows": rows})
        return 0


if __name__ == "__main__":
    sys.exit(main())
