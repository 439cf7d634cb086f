#!/usr/bin/env python
"""Tensor-parallel plans for Llama's MLP (course_utils.tensor_parallel.SwiGLU), each run on every rank against
the unsplit module: notebook 09's exercise runs the learner's plan here.

    torchrun --standalone --nproc-per-node=2 scripts/tp_plan.py --plans plans.pt

--plans: a file holding a list of plans, each {submodule name: ParallelStyle} as parallelize_module takes it
(torch.save; course_utils.exercises.run_tp_plans writes it). For each plan, on the same weights and the same
input on every rank: one forward and backward pass of the split module against the whole one, the largest
difference of the output and of the input's gradient, the share of the weights this rank holds, and the
collectives run each way. A plan that fails is reported with its error's first line. The last line is
RESULT {json} (rank 0).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.errors import first_line
from course_utils.results import emit_result
from course_utils.tensor_parallel import CollectiveBytes, SwiGLU


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plans", required=True, help="a torch.save'd list of parallelize_module plans")
    p.add_argument("--hidden", type=int, default=64, help="model width; 4 x hidden must divide by the ranks (default: 64)")
    add_device_flag(p)
    return p


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def try_plan(plan: dict[str, Any], mesh, hidden: int, x: torch.Tensor) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    dense = SwiGLU(hidden).to(x.device)
    torch.manual_seed(0)
    split = SwiGLU(hidden).to(x.device)
    x_dense, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_dense = dense(x_dense)
    out_dense.square().mean().backward()
    forward, backward = CollectiveBytes(), CollectiveBytes()
    try:
        split = parallelize_module(split, mesh, plan)
        with forward:
            out = split(x_split)
            if isinstance(out, DTensor):  # the whole output, as the next layer would need it
                out = out.full_tensor()
        if out.shape != out_dense.shape:
            raise ValueError(f"the output on each rank has shape {tuple(out.shape)}, the unsplit module's "
                             f"{tuple(out_dense.shape)}")
        with backward:
            out.square().mean().backward()
    except Exception as exc:  # the plan's failure is the result: every rank fails alike (same shapes, same plan)
        return {"error": first_line(exc, with_type=True)}
    held = sum(local(p).numel() for p in split.parameters())
    return {"error": None,
            "output_gap": (out.detach() - out_dense.detach()).abs().max().item(),
            "input_grad_gap": (x_split.grad - x_dense.grad).abs().max().item(),
            "weight_share": held / sum(p.numel() for p in dense.parameters()),
            "forward": dict(forward.calls), "forward_bytes": dict(forward.bytes), "backward": dict(backward.calls)}


def main() -> int:
    args = build_parser().parse_args()
    plans = torch.load(args.plans, weights_only=False)  # the learner's own objects, written by the checker
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "tp_plan.py", " (the layers are split over the ranks)")
        mesh = cdist.parallel_mesh(device, info.world_size)["tp"]
        x = torch.randn(4, 8, args.hidden, generator=torch.Generator().manual_seed(0)).to(device)
        rows = [try_plan(plan, mesh, args.hidden, x) for plan in plans]
        every = [None] * info.world_size
        dist.all_gather_object(every, rows)
        # the worst rank decides: a gap, an error or a larger share on any rank counts
        worst = []
        for k, row in enumerate(rows):
            mine = [r[k] for r in every]
            errors = [r["error"] for r in mine if r["error"]]
            worst.append({"error": errors[0]} if errors else
                         {**row, **{key: max(r[key] for r in mine) for key in ("output_gap", "input_grad_gap", "weight_share")}})
        emit_result({"script": "tp_plan.py", "ranks": info.world_size, "device": str(device), "hidden": args.hidden,
                     "plans": worst})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
