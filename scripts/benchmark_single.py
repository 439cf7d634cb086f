#!/usr/bin/env python
"""Single-device speed-up ladder: the fp32 textbook loop, DataLoader workers, pinned
memory, cudnn.benchmark, TF32, channels_last, AMP, torch.compile -- measured
side by side in one run. Prints a table and writes it as JSON.

    python scripts/benchmark_single.py                  # sized by COURSE_PROFILE
    python scripts/benchmark_single.py --model resnet18 --batch-size 256 --json runs/ladder.json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from course_utils import pick
from course_utils.checkpoint import ensure_writable_dir
from course_utils.hardware import environment_report
from course_utils.ladder import LadderSettings, best_speedup, ladder_table, run_ladder
from course_utils.models import MODELS


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default=pick(ci="cnn", full="resnet18"))
    p.add_argument("--batch-size", type=int, default=pick(ci=64, full=256))
    p.add_argument("--steps", type=int, default=pick(ci=10, full=50), help="timed steps per rung")
    p.add_argument("--untimed-steps", type=int, default=pick(ci=3, full=10),
                   help="steps per rung before the clock starts")
    p.add_argument("--workers", type=int, default=pick(ci=2, full=8), help="workers for the workers rung")
    p.add_argument("--device", default="auto")
    p.add_argument("--compile-on-cpu", action="store_true", help="also try torch.compile on a CPU")
    p.add_argument("--json", type=Path, default=Path("runs/benchmark_single.json"), help="where to write results")
    args = p.parse_args(argv)
    for name in ("batch_size", "steps", "untimed_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.workers < 0:
        p.error("--workers must be >= 0")
    try:
        ensure_writable_dir(args.json.parent, "output folder")
    except PermissionError as exc:
        p.error(str(exc))

    env = environment_report()
    where = ", ".join(g["name"] for g in env["gpus"]) or f"CPU ({env['cpu']}, {env['cores_usable']} cores)"
    print(f"device: {where}; torch {env['torch']}")
    settings = LadderSettings(
        model=args.model, batch_size=args.batch_size, steps=args.steps, untimed_steps=args.untimed_steps,
        workers=args.workers, device=args.device, compile_on_cpu=args.compile_on_cpu,
    )
    print(f"{args.model}, batch {args.batch_size}, {args.steps} timed steps per rung\n")
    try:
        results = run_ladder(settings)
    except RuntimeError as exc:  # e.g. --device cuda without a GPU
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print("\n" + ladder_table(results))
    best = best_speedup(results)
    print(f"\nbest configuration: {best:.2f}x the fp32 textbook loop (PyTorch defaults) on {where}")
    args.json.write_text(json.dumps(
        {"settings": asdict(settings), "device": where, "environment": env,
         "rungs": [asdict(r) for r in results], "best_speedup": best},
        indent=2, default=str,
    ))
    print(f"results written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
