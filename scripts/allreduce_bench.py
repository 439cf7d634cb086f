#!/usr/bin/env python
"""All-reduce two ways: the built-in ``dist.all_reduce`` and the ring written
by hand in ``course_utils.collectives``. First checks that they agree (on
sizes that do not divide by the number of ranks), then sweeps message sizes
and reports algorithm and bus bandwidth, as nccl-tests does.

    torchrun --standalone --nproc-per-node=4 scripts/allreduce_bench.py --max-mib 256
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.collectives import bandwidths, ring_all_reduce, time_op
from course_utils.devices import add_device_flag
from course_utils.results import emit_result


def check_ring(device: torch.device, sizes: list[int]) -> tuple[bool, float]:
    """Compare the ring with dist.all_reduce: integers must match exactly; for
    floats, return the largest relative difference (summation order differs)."""
    exact, worst = True, 0.0
    for n in sizes:
        g = torch.Generator().manual_seed(1000 * n + dist.get_rank())
        ints = torch.randint(-1000, 1000, (n,), generator=g, dtype=torch.int64).to(device)
        mine, ref = ints.clone(), ints.clone()
        ring_all_reduce(mine)
        dist.all_reduce(ref)
        exact &= torch.equal(mine, ref)
        x = torch.randn(n, generator=g, dtype=torch.float64).to(device)
        mine, ref = x.clone(), x.clone()
        ring_all_reduce(mine)
        dist.all_reduce(ref)
        worst = max(worst, float(((mine - ref).abs().max() / ref.abs().max().clamp_min(1e-12)).item()))
    return exact, worst


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--min-kib", type=int, default=4)
    p.add_argument("--max-mib", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-ring", action="store_true", help="time only the built-in all_reduce")
    p.add_argument("--check-only", action="store_true", help="only compare the ring with dist.all_reduce")
    p.add_argument("--json", type=Path, default=None)
    add_device_flag(p)
    args = p.parse_args()
    if args.min_kib < 1 or args.max_mib * 1024 < args.min_kib or args.iters < 1:
        p.error("need 1 <= --min-kib <= --max-mib*1024 and --iters >= 1")
    with cdist.session(args.device) as (info, device):
        n = info.world_size
        cdist.require_processes(2, "allreduce_bench.py")
        backend = dist.get_backend()
        sizes = [1, n - 1, n + 1, 1000, 1001, 65_537]
        exact, err = check_ring(device, sizes)
        cdist.print0(f"{n} ranks, backend {backend}, device {device.type}")
        cdist.print0(f"ring all-reduce vs dist.all_reduce on sizes {sizes}: int64 identical: {exact}; "
                     f"float64 max relative difference {err:.1e}")
        rows, traffic = [], []
        nbytes = args.min_kib * 1024 if not args.check_only else args.max_mib * 2**20 + 1
        # bus bandwidth is in the JSON and the notebook's chart, not beside algbw here: their ratio is 02's exercise
        cdist.print0(f"\n{'bytes':>12s} {'impl':>8s} {'time ms':>9s} {'algbw GB/s':>11s}")
        while nbytes <= args.max_mib * 2**20:
            x = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
            impls = {"builtin": lambda x=x: dist.all_reduce(x)}
            if not args.no_ring:
                impls["ring"] = lambda x=x: ring_all_reduce(x)
            if not args.no_ring:  # what one ring all-reduce of this buffer sends from this rank, counted
                sent: list[int] = []
                ring_all_reduce(x.clone(), sent)
                traffic.append({"world": n, "nbytes": nbytes, "sent_per_rank": sum(sent), "messages": len(sent)})
            for name, fn in impls.items():
                seconds = time_op(fn, device, iters=args.iters)
                alg, bus = bandwidths("all_reduce", nbytes, seconds, n)
                rows.append({"bytes": nbytes, "impl": name, "seconds": seconds, "algbw": alg, "busbw": bus})
                cdist.print0(f"{nbytes:12,d} {name:>8s} {1e3 * seconds:9.3f} {alg:11.3f}")
            nbytes *= 4
        result = {"world_size": n, "backend": backend, "device": device.type, "ring_int_exact": exact,
                  "ring_max_rel_diff": err, "rows": rows, "ring_traffic": traffic}
        if args.json and cdist.is_main_process():
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(result, indent=2))
        emit_result({k: v for k, v in result.items() if k not in ("rows", "ring_traffic")})
        return 0 if exact and err < 1e-12 else 1


if __name__ == "__main__":
    sys.exit(main())
