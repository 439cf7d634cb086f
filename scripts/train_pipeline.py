#!/usr/bin/env python
"""Pipeline parallelism with torch.distributed.pipelining: GPipe and 1F1B (one stage per rank), and the
interleaved 1F1B (two model chunks per rank).

    torchrun --standalone --nproc-per-node=4 scripts/train_pipeline.py
    torchrun --standalone --nproc-per-node=4 scripts/train_pipeline.py --microbatches 4 8 16 --compute-ms 40

An MLP of 2 blocks per rank is cut into one stage per rank (PipelineStage, a manual split).
First, for each schedule, a few SGD steps on the same batches as the unsplit model, which every
rank also trains by itself: the pipeline's losses and weights must be the unsplit model's. Then,
for each schedule and number of micro-batches, one timed step in which every stage's compute is
--compute-ms per micro-batch forward (twice that backward; course_utils.pipeline.SimulatedWork),
so that the bubble is the schedule's: its measured share of the step beside (p-1)/(m+p-1), and the
micro-batches whose activations each stage held at most. Under the interleaved schedule the MLP is cut
into 2 stages per rank (rank r runs stages r and r+p), each sleeping half of the rank's compute. The
last line is RESULT {json} (rank 0).

With --train, the course's run instead, with the course's flags (course_utils.config), pipelined:

    torchrun --standalone --nproc-per-node=2 scripts/train_pipeline.py --train --model mlp --epochs 3 \
        --schedule 1f1b --microbatches 4 --ckpt-dir runs/pp

The `mlp` model's units (stem, residual blocks, head) are dealt to one stage per rank
(course_utils.pipeline.ModelStage); every rank reads the same batches (the first stage feeds the
inputs, the last the labels) and steps the optimizer on its own stage's weights. The losses are
train.py's in one process, to rounding. With --ckpt-dir each rank writes its stage's weights and
optimizer state every epoch (torch.distributed.checkpoint, one checkpoint for the whole model) and a
new run resumes from it.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

import torch
import torch.distributed as dist
from torch import nn

from course_utils import process_group as cdist
from course_utils.config import add_config_args, config_from_args, resume_mismatch
from course_utils.errors import fail
from course_utils.pipeline import (
    SCHEDULES,
    TIMED,
    ModelStage,
    Stage,
    bubble_theory,
    build_mlp,
    chunks,
    held_theory,
    min_microbatches,
    mse,
    rank_stages,
    schedule_class,
    schedule_order,
    split,
)
from course_utils.results import emit_result
from course_utils.timing import sync
from course_utils.trainer import build_optimizer


# what --train does not implement: it says so rather than train without it
LEFT_OUT = {"trace_dir", "grad_accum", "warmup_epochs", "precision", "tf32", "cudnn_benchmark", "channels_last", "compile",
            "bucket_cap_mb", "grad_as_bucket_view", "ckpt_every_steps", "log_dir"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    pp = p.add_argument_group("pipeline")
    pp.add_argument("--train", action="store_true",
                    help="train the course's run pipelined (--model mlp) with --schedule and --microbatches")
    pp.add_argument("--schedule", choices=SCHEDULES, default="1f1b", help="--train's schedule (default: 1f1b)")
    pp.add_argument("--schedules", nargs="+", choices=TIMED, default=list(TIMED),
                    help="the schedules to time (default: all three; interleaved: 1F1B over 2 model chunks per rank)")
    pp.add_argument("--microbatches", nargs="+", type=int, default=None,
                    help="micro-batches per step to time (1F1B needs at least one per stage) (default: 1 2 4 8 16); "
                         "with --train, micro-batches per batch (default: 4)")
    pp.add_argument("--compute-ms", type=float, default=20.0,
                    help="simulated forward time per micro-batch and stage, in ms (backward: twice) (default: 20)")
    pp.add_argument("--hidden", type=int, default=64, help="width of the timed MLP (default: 64)")
    pp.add_argument("--steps", type=int, default=3, help="SGD steps compared with the unsplit model (default: 3)")
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


def build_schedule(name: str, modules: list[nn.Module], rank: int, ranks: int, microbatches: int,
                   device: torch.device):
    """``name``'s schedule over this rank's stages (``modules``, one per stage of ``rank_stages``)."""
    from torch.distributed.pipelining import PipelineStage

    total = ranks * chunks(name)
    stages = [PipelineStage(module, index, total, device)
              for module, index in zip(modules, rank_stages(name, rank, ranks))]
    return schedule_class(name)(stages if chunks(name) > 1 else stages[0], n_microbatches=microbatches, loss_fn=mse)


def compare_with_unsplit(name: str, stage: int, stages: int, hidden: int, steps: int,
                         device: torch.device) -> dict[str, float]:
    """``steps`` SGD steps through the pipeline and through the unsplit model, on the same batches."""
    microbatches = max(4, stages)
    total = stages * chunks(name)  # pipeline stages: one per rank, or several (interleaved)
    whole = build_mlp(hidden, 2 * total).to(device)
    mine = [split(build_mlp(hidden, 2 * total), total, i).to(device)  # the same weights, this rank's share
            for i in rank_stages(name, stage, stages)]
    pipe = build_schedule(name, [Stage(m) for m in mine], stage, stages, microbatches, device)
    opt_pipe = build_optimizer([p for m in mine for p in m.parameters()], "sgd", lr=0.1)
    opt_whole = build_optimizer(whole.parameters(), "sgd", lr=0.1)
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
    reference = [split(whole, total, i) for i in rank_stages(name, stage, stages)]
    param_diff = max((a - b).abs().max().item() for m, r in zip(mine, reference)
                     for a, b in zip(m.parameters(), r.parameters()))
    return {"loss_diff": loss_diff, "param_diff": param_diff}


def time_schedule(name: str, microbatches: int, stage: int, stages: int, hidden: int, compute_s: float,
                  device: torch.device) -> dict:
    """One step on this rank, from a common start: its seconds (``step_s``), the micro-batches this stage held
    at most (``held``; None for several chunks per rank), when it ran each pass (``events``: name, start,
    end, in seconds from the start; a second chunk's passes marked ``'``), and the seconds of the same step
    without the simulated compute (``bare_s``: the sends and Python alone). A rank's compute per micro-batch
    is ``compute_s`` forward however many chunks it runs: each chunk sleeps its share."""
    total = stages * chunks(name)
    modules = [Stage(split(build_mlp(hidden, 2 * total), total, i).to(device)) for i in rank_stages(name, stage, stages)]
    pipe = build_schedule(name, modules, stage, stages, microbatches, device)
    x = torch.randn(4 * microbatches, hidden, device=device)
    y = torch.randn(4 * microbatches, hidden, device=device)

    def timed() -> tuple[float, float]:
        dist.barrier()
        start = time.perf_counter()
        one_step(pipe, stage, stages, x, y)
        sync(device)
        return start, time.perf_counter() - start

    one_step(pipe, stage, stages, x, y)  # untimed, without the simulated compute: it infers the shapes sent
    _, bare_s = timed()
    for module in modules:
        module.forward_s = compute_s / len(modules)
        module.reset_meter()
    start, step_s = timed()
    events = [(pass_ + "'" * chunk, round(a - start, 6), round(b - start, 6))
              for chunk, module in enumerate(modules) for pass_, a, b in module.meter["events"]]
    held = modules[0].meter["peak"] if len(modules) == 1 else None
    return {"step_s": step_s, "held": held, "events": sorted(events, key=lambda e: e[1]), "bare_s": bare_s}


def microbatch_plan(schedules: list[str], wanted: list[int], stages: int) -> tuple[str | None, list[str]]:
    """What the timing can run: a refusal when a schedule can run none of ``wanted``, else the notes on
    the counts it leaves out (1F1B needs a micro-batch per stage)."""
    notes = []
    for name in schedules:
        least = min_microbatches(name, stages)
        if all(m < least for m in wanted):
            return f"{name} needs at least {least} micro-batches for {stages} stages: --microbatches {least} or more", []
        if any(m < least for m in wanted):
            notes.append(f"{name}: m < {least} left out ({name} needs a micro-batch per stage, {stages} stages)")
    return None, notes


def train(args: argparse.Namespace) -> int:
    """The course's run (--model mlp), one stage per rank, through --schedule with --microbatches[0]."""
    from torch.distributed.pipelining import PipelineStage
    from tqdm.auto import tqdm

    from course_utils.checkpoint import CheckpointError, ensure_writable_dir
    from course_utils.data import get_datasets, make_loader, set_epoch
    from course_utils.models import build_model
    from course_utils.rng import rng_state_json, set_rng_state_json
    from course_utils.checkpoint import latest_sharded, load_sharded, save_sharded
    from course_utils.sharding import start_rank
    from course_utils.trainer import config_lr, evaluate, make_optimizer

    cfg = config_from_args(args)
    m = args.microbatches[0] if args.microbatches else 4
    if cfg.model != "mlp":
        sys.exit(fail("--train pipelines --model mlp (its stem, residual blocks and head are dealt to the stages)"))
    if cfg.dataset == "shards":
        sys.exit(fail("every pipeline stage must read the same batches, and shards are dealt out to the ranks: "
                 "use --dataset synthetic, cifar10 or mnist with --train"))
    if cfg.batch_size % m:
        sys.exit(fail(f"--batch-size {cfg.batch_size} does not split into {m} equal micro-batches"))
    info, device, _ = start_rank(cfg, "train_pipeline.py --train", LEFT_OUT)  # the course's door
    cdist.require_processes(2, "train_pipeline.py --train", " (one pipeline stage per rank)")
    stage, stages = info.rank, info.world_size
    if m < min_microbatches(args.schedule, stages):
        sys.exit(fail(f"{args.schedule} needs at least {min_microbatches(args.schedule, stages)} micro-batches "
                 f"for {stages} stages: --microbatches {min_microbatches(args.schedule, stages)}"))
    # everything as train.py draws it, so the run is train.py's, pipelined
    torch.manual_seed(cfg.seed)
    train_ds, val_ds, meta = get_datasets(cfg.dataset, cfg.data_root, cfg.n_train, cfg.n_val, seed=cfg.seed)
    pin = cfg.pin_memory and device.type == "cuda"
    loader = make_loader(train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers, pin_memory=pin,
                         persistent_workers=cfg.workers > 0, drop_last=True, seed=cfg.seed, replica=(0, 1))
    val_loader = make_loader(val_ds, 2 * cfg.batch_size, shuffle=False, workers=cfg.workers, seed=cfg.seed)
    mine = ModelStage(build_model(cfg.model, meta.channels, meta.num_classes), stages, stage).to(device)
    optimizer = make_optimizer(mine, cfg, config_lr(cfg, 1))  # one model replica: the batch is the global batch
    pipe = schedule_class(args.schedule)(PipelineStage(mine, stage, stages, device), n_microbatches=m,
                                         loss_fn=nn.functional.cross_entropy)
    units = cdist.gathered(mine.units)
    cdist.print0(f"{stages} stages, {args.schedule}, {m} micro-batches of {cfg.batch_size // m}; units per stage: "
                 + "; ".join(f"{r}: {' '.join(u)}" for r, u in enumerate(units)))

    losses, step, first_epoch, resumed_from = [], 0, 0, None
    ckpt = ensure_writable_dir(cfg.ckpt_dir, "checkpoint folder") if cfg.ckpt_dir else None
    saved = latest_sharded(ckpt) if ckpt and cfg.resume else None
    if saved:
        try:
            progress = load_sharded(saved, mine, optimizer)  # each rank reads its stage's weights and state
        except CheckpointError as exc:
            sys.exit(fail(str(exc)))
        mismatch = resume_mismatch(progress["config"], cfg)
        if progress["stages"] != stages:
            mismatch.append(f"{progress['stages']} stages -> {stages}")
        if mismatch:
            sys.exit(fail(f"{ckpt} was written by another run ({'; '.join(mismatch)}): use a new --ckpt-dir"))
        first_epoch, step, losses, resumed_from = progress["epoch"], progress["step"], progress["losses"], str(saved)
        set_rng_state_json(progress["rng"])  # augmentation draws from it: the next epoch sees the same images
        cdist.print0(f"resumed from {saved} after epoch {first_epoch} (step {step})")
    for epoch in range(first_epoch, cfg.epochs):
        set_epoch(loader, epoch)  # the epoch's order, the same on every rank: the stages see the same batches
        mine.train()
        total, count = 0.0, 0
        n = min(len(loader), cfg.steps_per_epoch or len(loader))
        bar = tqdm(loader, total=n, desc=f"epoch {epoch}", leave=False, disable=not (cfg.progress and stage == 0))
        for i, (x, y) in enumerate(bar):
            if i == n:
                break
            optimizer.zero_grad(set_to_none=True)
            out = one_step(pipe, stage, stages, x.to(device, non_blocking=True), y.to(device, non_blocking=True))
            optimizer.step()  # this stage's weights only
            step += 1
            if out:  # the last stage: the batch's loss is the mean of its micro-batches'
                total, count = total + torch.stack(out).mean().item(), count + 1
        bar.close()
        mean = torch.tensor([total / max(count, 1)], device=device)
        dist.broadcast(mean, src=stages - 1)  # the loss is known on the last stage
        losses.append(mean.item())
        cdist.print0(f"epoch {epoch}: train loss {losses[-1]:.4f}")
        if ckpt:
            save_sharded(ckpt, mine, optimizer, {"epoch": epoch + 1, "step": step, "losses": losses,
                                                 "stages": stages, "config": asdict(cfg),
                                                 "rng": rng_state_json()})
    # the whole model on every rank, from the stages' weights, to evaluate as every trainer does
    whole = build_model(cfg.model, meta.channels, meta.num_classes)
    parts = cdist.gathered({k: v.detach().cpu() for k, v in mine.state_dict().items()})
    whole.load_state_dict({k: v for part in parts for k, v in part.items()})
    val_loss, val_acc = evaluate(whole.to(device), val_loader, device)
    if stage == 0:
        emit_result({"trainer": "train_pipeline.py", "stages": stages, "schedule": args.schedule, "microbatches": m,
                     "device": str(device), "units": units, "epochs": cfg.epochs,
                     "global_step": step, "train_loss": losses, "val_loss": val_loss, "val_acc": val_acc,
                     "resumed_from": resumed_from})
    cdist.cleanup()
    return 0


def main() -> int:
    args = build_parser().parse_args()
    if args.train:
        return train(args)
    with cdist.session(config_from_args(args).device) as (info, device):
        cdist.require_processes(2, "train_pipeline.py", " (one pipeline stage per rank)")
        stage, stages = info.rank, info.world_size
        wanted = sorted(args.microbatches or [1, 2, 4, 8, 16])
        refused, notes = microbatch_plan(args.schedules, wanted, stages)  # said before anything runs
        for line in notes:
            cdist.print0(line)
        if refused:
            cdist.print0(f"error: {refused}")
            return 2
        checks = {name: compare_with_unsplit(name, stage, stages, args.hidden, args.steps, device)
                  for name in args.schedules}
        rows = []
        for name in args.schedules:
            for m in wanted:
                if m < min_microbatches(name, stages):
                    continue
                mine = time_schedule(name, m, stage, stages, args.hidden, args.compute_ms / 1000, device)
                every = cdist.gathered(mine)
                step_s = max(r["step_s"] for r in every)  # the step ends when the last stage is done
                one_chunk = chunks(name) == 1  # the activations held and the order: written down for one
                # the share of the step a stage was not computing, from when its passes ran (a sleep that
                # overran on a busy machine counts as the compute it stands for), averaged over the stages
                busy = [sum(end - start for _, start, end in r["events"]) for r in every]
                rows.append({"schedule": name, "microbatches": m, "chunks": chunks(name), "step_s": step_s,
                             "bubble": 1 - sum(busy) / len(busy) / step_s,
                             "theory": bubble_theory(stages, m), "held": [r["held"] for r in every],
                             "held_theory": [held_theory(name, stages, m, s) for s in range(stages)] if one_chunk else None,
                             "bare_s": max(r["bare_s"] for r in every), "events": [r["events"] for r in every],
                             "order_theory": [schedule_order(name, stages, m, s) for s in range(stages)] if one_chunk else None})
                cdist.print0(f"{name:11s} m={m:3d}: step {step_s:.3f} s, bubble {rows[-1]['bubble']:.2f} "
                             f"((p-1)/(m+p-1) {rows[-1]['theory']:.2f}), micro-batches held per stage {rows[-1]['held']}")
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
