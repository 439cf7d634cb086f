#!/usr/bin/env python
"""Weak scaling of DDP on one node: scripts/train.py under torchrun with
1, 2, 4, ... ranks, the batch per rank fixed. Prints a table and writes JSON.

    python scripts/benchmark_ddp.py --world-sizes 1 2 4 8 --model resnet18 --batch-size 128
    python scripts/benchmark_ddp.py --device cpu --world-sizes 1 2 4 8   # gloo ranks on CPU cores
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from course_utils import pick
from course_utils.hardware import threads_per_rank
from course_utils.models import MODELS
from course_utils.scaling import OPTIMISED, measure_scaling, optimised_args, scaling_table


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    gpus = torch.cuda.device_count()
    p.add_argument("--world-sizes", type=int, nargs="+", default=None,
                   help="default: 1, 2, 4, ... up to the GPUs here (2 on a CPU)")
    p.add_argument("--model", choices=MODELS, default=pick(ci="cnn", full="resnet18"))
    p.add_argument("--batch-size", type=int, default=pick(ci=32, full=128), help="per rank")
    p.add_argument("--steps", type=int, default=pick(ci=10, full=60))
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--textbook", action="store_true",
                   help="measure the fp32 textbook loop (no workers, no AMP) instead of the optimised setup")
    p.add_argument("--threads-per-rank", type=int, default=None, help="CPU threads per rank (CPU runs)")
    p.add_argument("--json", type=Path, default=Path("runs/benchmark_ddp.json"))
    args = p.parse_args()
    sizes = args.world_sizes or [n for n in (1, 2, 4, 8, 16) if n <= max(gpus, 2)]
    if any(n < 1 for n in sizes) or args.batch_size < 1 or args.steps < 1:
        p.error("world sizes, --batch-size and --steps must be >= 1")
    on_gpu = args.device != "cpu" and gpus > 0
    if on_gpu and max(sizes) > gpus:
        p.error(f"--world-sizes up to {max(sizes)} but only {gpus} GPUs here; use --device cpu for gloo ranks")
    threads = None if on_gpu else (args.threads_per_rank or threads_per_rank(max(sizes)))
    steps = args.steps + 2  # the Trainer does not time its first 2 steps
    setup = ["--precision", "fp32", "--workers", "0"] if args.textbook else optimised_args(on_gpu, max(sizes))
    train_args = ["--model", args.model, "--batch-size", args.batch_size, "--epochs", 1,
                  "--steps-per-epoch", steps, "--n-train", args.batch_size * steps * max(sizes),
                  "--n-val", 64, "--device", "cuda" if on_gpu else "cpu", *setup]
    where = f"{torch.cuda.get_device_name(0)}, NCCL" if on_gpu else f"CPU, gloo, {threads} thread(s) per rank"
    print(f"weak scaling of {args.model}, batch {args.batch_size} per rank, on {where}")
    print("baseline: " + ("the fp32 textbook loop" if args.textbook else f"the optimised setup: {OPTIMISED}"))
    rows = measure_scaling(sizes, train_args, threads_per_rank=threads)
    print(scaling_table(rows))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"model": args.model, "batch_per_rank": args.batch_size, "where": where,
                                     "setup": setup, "rows": rows}, indent=2))
    last = rows[-1]
    print(f"efficiency at {last['world_size']} ranks: {100 * last['efficiency']:.0f}%  (written to {args.json})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
