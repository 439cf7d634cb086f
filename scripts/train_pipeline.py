#!/usr/bin/env python
"""Pipeline parallelism with torch.distributed.pipelining: one stage per rank, GPipe and 1F1B.

    torchrun --standalone --nproc-per-node=4 scripts/train_pipeline.py
    torchrun --standalone --nproc-per-node=4 scripts/train_pipeline.py --microbatches 4 8 16 --compute-ms 40

An MLP of 2 blocks per rank is cut into one stage per rank (PipelineStage, a manual split).
First, for each schedule, a few SGD steps on the same batches as the unsplit model, which every
rank also trains by itself: the pipeline's losses and weights must be the unsplit model's. Then,
for each schedule and number of micro-batches, one timed step in which every stage's compute is
--compute-ms per micro-batch forward (twice that backward; course_utils.pipeline.SimulatedWork),
so that the bubble is the schedule's: its measured share of the step beside (p-1)/(m+p-1), and the
micro-batches whose activations each stage held at most. The last line is RESULT {json} (rank 0).
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

from course_utils import dist as cdist
from course_utils.devices import add_device_flag
from course_utils.pipeline import (
    SCHEDULES,
    Stage,
    bubble_theory,
    build_mlp,
    held_theory,
    min_microbatches,
    mse,
    schedule_class,
    split,
)
from course_utils.results import emit_result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schedules", nargs="+", choices=SCHEDULES, default=list(SCHEDULES))
    p.add_argument("--microbatches", nargs="+", type=int, default=[1, 2, 4, 8, 16],
                   help="micro-batches per step to time (1F1B needs at least one per stage) (default: 1 2 4 8 16)")
    p.add_argument("--compute-ms", type=float, default=20.0,
                   help="simulated forward time per micro-batch and stage, in ms (backward: twice) (default: 20)")
    p.add_argument("--hidden", type=int, default=64, help="width of the MLP (default: 64)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps compared with the unsplit model (default: 3)")
    add_device_flag(p)
    return p


def one_step(schedule, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One pipeline step: the first stage feeds the batch, the last computes the loss of each micro-batch."""
    losses: list[torch.Tensor] = []
    if stage == 0:
        schedule.step(x)
    elif stage == stages - 1:
        schedule.step(target=y, losses=losses)
    else:
        schedule.step()
    return losses


def compare_with_unsplit(name: str, stage: int, stages: int, hidden: int, steps: int,
                         device: torch.device) -> dict[str, float]:
    """``steps`` SGD steps through the pipeline and through the unsplit model, on the same batches."""
    from torch.distributed.pipelining import PipelineStage

    microbatches = max(4, stages)
    whole = build_mlp(hidden, 2 * stages).to(device)
    mine = split(build_mlp(hidden, 2 * stages), stages, stage).to(device)  # the same weights, this stage's share
    pipe = schedule_class(name)(PipelineStage(Stage(mine), stage, stages, device), n_microbatches=microbatches,
                                loss_fn=mse)
    opt_pipe = torch.optim.SGD(mine.parameters(), lr=0.1)
    opt_whole = torch.optim.SGD(whole.parameters(), lr=0.1)
    loss_diff = 0.0
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        x = torch.randn(8 * microbatches, hidden, generator=gen).to(device)
        y = torch.randn(8 * microbatches, hidden, generator=gen).to(device)
        opt_pipe.zero_grad()
        losses = one_step(pipe, stage, stages, x, y)
        opt_pipe.step()
        opt_whole.zero_grad()
        whole_loss = mse(whole(x), y)
        whole_loss.backward()
        opt_whole.step()
        if losses:  # the last stage: the mean of the micro-batches' losses is the batch's loss
            loss_diff = max(loss_diff, abs(torch.stack(losses).mean().item() - whole_loss.item()))
    reference = split(whole, stages, stage)
    param_diff = max((a - b).abs().max().item() for a, b in zip(mine.parameters(), reference.parameters()))
    return {"loss_diff": loss_diff, "param_diff": param_diff}


def time_schedule(name: str, microbatches: int, stage: int, stages: int, hidden: int, compute_s: float,
                  device: torch.device) -> tuple[float, int]:
    """Seconds of one step (this rank's, from a common start) and the micro-batches this stage held at most."""
    from torch.distributed.pipelining import PipelineStage

    module = Stage(split(build_mlp(hidden, 2 * stages), stages, stage).to(device))
    pipe = schedule_class(name)(PipelineStage(module, stage, stages, device), n_microbatches=microbatches,
                                loss_fn=mse)
    x = torch.randn(4 * microbatches, hidden, device=device)
    y = torch.randn(4 * microbatches, hidden, device=device)
    one_step(pipe, stage, stages, x, y)  # untimed, without the simulated compute: it infers the shapes sent
    module.forward_s = compute_s
    module.reset_meter()
    dist.barrier()
    start = time.perf_counter()
    one_step(pipe, stage, stages, x, y)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, module.meter["peak"]


def main() -> int:
    args = build_parser().parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "train_pipeline.py", " (one pipeline stage per rank)")
        stage, stages = info.rank, info.world_size
        checks = {name: compare_with_unsplit(name, stage, stages, args.hidden, args.steps, device)
                  for name in args.schedules}
        rows = []
        for name in args.schedules:
            for m in sorted(args.microbatches):
                if m < min_microbatches(name, stages):
                    continue
                seconds, held = time_schedule(name, m, stage, stages, args.hidden, args.compute_ms / 1000, device)
                gathered = [None] * stages
                dist.all_gather_object(gathered, (seconds, held))
                step_s = max(s for s, _ in gathered)  # the step ends when the last stage is done
                rows.append({"schedule": name, "microbatches": m, "step_s": step_s,
                             "bubble": 1 - m * 3 * args.compute_ms / 1000 / step_s,
                             "theory": bubble_theory(stages, m), "held": [h for _, h in gathered],
                             "held_theory": [held_theory(name, stages, m, s) for s in range(stages)]})
                cdist.print0(f"{name:5s} m={m:3d}: step {step_s:.3f} s, bubble {rows[-1]['bubble']:.2f} "
                             f"(theory {rows[-1]['theory']:.2f}), micro-batches held per stage {rows[-1]['held']}")
        all_checks = [None] * stages
        dist.all_gather_object(all_checks, checks)
        worst = {name: {k: max(c[name][k] for c in all_checks) for k in ("loss_diff", "param_diff")}
                 for name in args.schedules}
        for name, w in worst.items():
            cdist.print0(f"{name} against the unsplit model over {args.steps} steps: loss differs by at most "
                         f"{w['loss_diff']:.1e}, weights by {w['param_diff']:.1e}")
        if info.rank == 0:
            emit_result({"script": "train_pipeline.py", "stages": stages, "device": str(device),
                         "compute_ms": args.compute_ms, "against_unsplit": worst, "timed": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
