#!/usr/bin/env python
"""What a training step holds in memory, step by step (notebook 11).

Trains the course's model with AdamW for --steps steps and reports each step's peak, split into what
holds it: parameters, gradients, the optimizer's state, activations and temporaries, as
torch.distributed._tools.MemTracker counts the tensors alive at that moment. On a GPU it also reports
torch.cuda.max_memory_allocated and max_memory_reserved per step, and --snapshot writes the allocator's
history for https://pytorch.org/memory_viz.

AdamW creates its state in the first optimizer.step(), after step 1's peak: step 2 peaks higher by that
state, which is why a run can fit step 1 and fail at step 2. --cap-gib lets the GPU hand out only that
much, to see it happen.

--estimate counts without allocating (every tensor a FakeTensor: shapes and dtypes, no data), so a login
node or a laptop can size a step for a GPU it does not have, at each batch size it is given.

    python scripts/memory_steps.py --model cnn --batch-size 64
    python scripts/memory_steps.py --model resnet18 --estimate 64 256 --batch-size 16
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker

from course_utils.devices import add_device_flag
from course_utils.errors import first_line
from course_utils.models import MODELS, build_model, count_parameters
from course_utils.process_group import choose_device
from course_utils.results import emit_result

PARTS = {"Parameter": "params", "Gradient": "gradients", "Optstate": "optimizer", "Activation": "activations",
         "Temp": "temporaries", "Buffer": "buffers", "Other": "inputs"}


def step_peaks(model_name: str, batch: int, steps: int, device: torch.device) -> dict:
    """Each step's peak by part, with MemTracker; on a GPU, the allocator's own peaks too."""
    gpu = device.type == "cuda"
    torch.manual_seed(0)
    model = build_model(model_name)
    if device.type != "cpu":  # (a FakeTensor model stays where FakeTensorMode made it)
        model = model.to(device)
    # its state: two fp32 moments per parameter. foreach: the update a GPU runs by default (whole lists at once,
    # larger temporaries), here on every device, so that an estimate counts what a GPU will hold
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    x = torch.randn(batch, 3, 32, 32, device=device)  # a CIFAR-10 batch's shape
    y = torch.randint(0, 10, (batch,), device=device)
    rows, oom = [], None
    for step in range(1, steps + 1):
        if gpu:
            torch.cuda.reset_peak_memory_stats(device)
        tracker = MemTracker()
        tracker.track_external(model, opt, x, y)  # made before the tracker: counted from here
        try:
            with tracker:
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                opt.step()
                opt.zero_grad()  # gradients freed (set to None) before the next forward
        except torch.OutOfMemoryError as exc:
            oom = {"step": step, "message": first_line(exc)}
            break
        at_peak = next(v for d, v in tracker.get_tracker_snapshot("peak").items() if d.type == device.type)
        peak = {PARTS[str(k.value)]: v for k, v in at_peak.items() if k != "Total"}
        row = {"step": step, "peak": peak, "peak_total": sum(peak.values())}
        if gpu:
            row["max_allocated"] = torch.cuda.max_memory_allocated(device)
            row["max_reserved"] = torch.cuda.max_memory_reserved(device)
        rows.append(row)
    return {"params": count_parameters(model), "steps": rows, "oom": oom}


def run_at(args: argparse.Namespace, batch: int, device: torch.device, estimate: bool) -> dict:
    """One batch size's steps, measured on ``device`` or estimated with FakeTensors; printed a line a step."""
    with FakeTensorMode() if estimate else contextlib.nullcontext():
        run = step_peaks(args.model, batch, args.steps, device)
    how = "estimated" if estimate else f"measured on {device}"
    for row in run["steps"]:
        parts = ", ".join(f"{k} {v / 2**20:.1f}" for k, v in row["peak"].items() if v)
        gpu = f"; allocator's peak {row['max_allocated'] / 2**20:.1f} MiB" if "max_allocated" in row else ""
        print(f"batch {batch}, step {row['step']}, {how}: peak {row['peak_total'] / 2**20:.1f} MiB ({parts}){gpu}")
    if run["oom"]:
        print(f"batch {batch}, step {run['oom']['step']}: out of memory: {run['oom']['message']}")
    return {"batch": batch, **run}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="cnn")
    p.add_argument("--batch-size", type=int, nargs="*", default=None,
                   help="batch sizes measured for real on --device (default: 64, unless --estimate is given)")
    p.add_argument("--estimate", type=int, nargs="*", default=[],
                   help="batch sizes counted with FakeTensors: nothing allocated, no GPU needed")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--snapshot", type=Path, help="GPU: write the allocator's history here (for pytorch.org/memory_viz)")
    p.add_argument("--cap-gib", type=float, help="GPU: let this process allocate at most this many GiB")
    add_device_flag(p)
    args = p.parse_args(argv)
    if args.batch_size is None:
        args.batch_size = [] if args.estimate else [64]
    if args.steps < 1 or min(args.batch_size + args.estimate, default=1) < 1:
        p.error("--steps and every batch size must be >= 1")
    device = choose_device(args.device)
    if args.cap_gib is not None:
        if device.type != "cuda":
            p.error("--cap-gib caps a GPU's allocator; this run is on the CPU (leave it out, or run on a GPU)")
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, args.cap_gib * 2**30 / total), device)
    snapshot = args.snapshot if device.type == "cuda" else None
    if snapshot:  # every allocation and free from here on, with its Python stack
        torch.cuda.memory._record_memory_history(max_entries=200_000)
    measured = [run_at(args, b, device, estimate=False) for b in args.batch_size]
    if snapshot:
        snapshot.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(snapshot))
        torch.cuda.memory._record_memory_history(enabled=None)
    estimated = [run_at(args, b, torch.device("cpu"), estimate=True) for b in args.estimate]
    emit_result({"script": "memory_steps.py", "model": args.model, "device": str(device), "cap_gib": args.cap_gib,
                 "measured": measured, "estimated": estimated,
                 "snapshot": str(snapshot) if snapshot else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
