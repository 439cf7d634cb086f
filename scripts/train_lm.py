#!/usr/bin/env python
"""The course's transformer: a small Llama-style decoder trained on bytes of text, split over the ranks by
``course_utils.parallel`` on one mesh. The same seed and tokens give the same losses in every layout::

    python scripts/train_lm.py --steps 5                                         # one process, unsplit
    torchrun --standalone --nproc-per-node 2 scripts/train_lm.py --dp-shard 2    # FSDP2
    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --dp-shard 2 --tp 2   # FSDP2 x tensor parallel
    torchrun --standalone --nproc-per-node 4 scripts/train_lm.py --dp-replicate 2 --dp-shard 2   # HSDP
    torchrun --standalone --nproc-per-node 2 scripts/train_lm.py --pp 2 --microbatches 4         # a pipeline
    torchrun --standalone --nproc-per-node 2 scripts/train_lm.py --cp 2                          # ring attention
    python scripts/train_lm.py --experts 4                                                       # a mixture of experts

The product of the degrees is the world size. The text is this Python's standard library unless --text
names a file. Each step prints its loss and tokens/s (and, on a GPU, the model FLOPs utilisation against
the GPU's measured bf16 matmul rate, fp16's before Ampere); the last line is ``RESULT {json}`` with one loss per step
(``losses``) and the gradients' norm before clipping (``grad_norms``), so two layouts compare from
the command line. With --ckpt-dir every rank writes its shards
(torch.distributed.checkpoint) every --ckpt-every-steps and at the end, and a new run resumes from them on
any layout; SIGUSR1 (Slurm's warning) checkpoints at the next step and stops.
"""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from course_utils import process_group as cdist
from course_utils.checkpoint import CheckpointError, ensure_writable_dir, latest_sharded, load_sharded, save_sharded
from course_utils.config import GROUPS, TrainConfig, add_config_args, config_from_args, in_run_dir, resume_mismatch, \
    unsupported
from course_utils.data.text import TokenBatches, load_tokens
from course_utils.devices import PlacementError
from course_utils.errors import fail
from course_utils.hardware import peak_memory_mib, tensor_core_peak_tflops
from course_utils.llama import build_llama, flops_per_token, parameter_counts
from course_utils.parallel.context import WORK as ring_work
from course_utils.parallel.context import SENT as ring_sent
from course_utils.parallel.context import shard
from course_utils.parallel.checkpointing import SavedForBackward
from course_utils.parallel.experts import SENT as a2a_sent
from course_utils.parallel.experts import reduce_expert_grads, router_load
from course_utils.parallel import ParallelDims, build_schedule, clip_grad_norm, float8_problem, parallelize, \
    pipeline_eval, pipeline_step
from course_utils.precision import autocast, resolve_precision
from course_utils.preemption import StopRequest
from course_utils.results import emit_result
from course_utils.sharding import fsdp_precision, local_bytes
from course_utils.timing import sync
from course_utils.trainer import make_optimizer

DEFAULTS = {"optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.1, "batch_size": 8, "precision": "amp"}
LEFT_OUT = {"dataset", "data_root", "n_train", "n_val", "workers", "pin_memory", "model", "epochs", "momentum",
            "grad_accum", "scale_lr", "warmup_epochs", "steps_per_epoch", "tf32", "cudnn_benchmark", "channels_last",
            "bucket_cap_mb", "grad_as_bucket_view", "log_dir", "trace_dir", "progress"}
CLIP = 1.0  # the gradients' norm over every shard and rank, clipped: the same in every layout
VAL_SEQUENCES = 64


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p, GROUPS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        cfg = in_run_dir(config_from_args(args, DEFAULTS), logs=False)  # in a course Slurm job: RUN_DIR/ckpt
        unsupported(cfg, "train_lm.py", LEFT_OUT)
        with cdist.session(cfg.device, group_of_one=True) as (info, device):  # DCP and the mesh need a group
            return train(cfg, info, device)
    except (cdist.RendezvousError, PlacementError) as exc:
        return fail(str(exc), code=1)
    except (PermissionError, ValueError, CheckpointError) as exc:
        return fail(str(exc))


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The mean next-token cross-entropy; with the vocabulary split (tensor parallel), computed on the shards by
    ``loss_parallel``: call it, and ``backward``, inside :func:`loss_context`."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


class Step:
    """This rank's forward and backward of a step's batch, and its loss: the whole model, or its pipeline stage
    (the loss then on the last stage only, a zero elsewhere)."""

    def __init__(self, model, dims: ParallelDims, mesh, cfg: TrainConfig, precision: str,
                 device: torch.device) -> None:
        self.model, self.dims, self.precision, self.device = model, dims, precision, device
        self.aux_weight, self.mesh = cfg.aux_loss, mesh
        self.stage = mesh["pp"].get_local_rank()
        self.schedule = build_schedule(model, self.stage, dims.pp, mesh["pp"], device, cfg.microbatches,
                                       next_token_loss, cfg.pp_schedule) if dims.pp_enabled else None

    def _mean(self, losses: list[torch.Tensor]) -> torch.Tensor:
        return torch.stack(losses).mean() if losses else torch.zeros((), device=self.device)

    def train(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with loss_context(self.dims.tp_enabled), autocast(self.precision, self.device):
            if self.schedule is not None:
                return self._mean(pipeline_step(self.schedule, self.stage, self.dims.pp, x, y))
            loss = next_token_loss(self.model(x), y)
            (loss + self.aux_weight * self.balancing_loss()).backward()
        if self.dims.ep_enabled:  # the spread experts' gradients, averaged as FSDP2 averages the rest
            replicas = self.mesh["dp_replicate"].get_group() if self.dims.hsdp_enabled else None
            reduce_expert_grads(self.model, self.dims.dp, replicas)
        return loss

    def balancing_loss(self) -> torch.Tensor | float:
        """The experts' load-balancing losses of this step's forward, summed over the blocks (0 when dense)."""
        blocks = [getattr(b, "_checkpoint_wrapped_module", b) for b in self.model.layers.values()]
        return sum(b.feed_forward.aux_loss for b in blocks if hasattr(b.feed_forward, "aux_loss")) or 0.0

    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor | None:
        with torch.no_grad(), loss_context(self.dims.tp_enabled), autocast(self.precision, self.device):
            if self.schedule is not None:
                losses = pipeline_eval(self.schedule, self.stage, self.dims.pp, x, y)
                return None if losses is None else self._mean(losses)
            return next_token_loss(self.model(x), y)


def loss_context(split_vocab: bool) -> contextlib.AbstractContextManager:
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel() if split_vocab else contextlib.nullcontext()


def mean_over_ranks(value: torch.Tensor, dims: ParallelDims) -> float:
    """A loss averaged over the data-parallel ranks: the tensor-parallel ranks hold the same one, each
    context-parallel rank its tokens' mean (as many tokens each), and in a pipeline only the last stage's ranks
    hold one (the others add a zero)."""
    value = value.full_tensor() if hasattr(value, "full_tensor") else value
    total = value.detach().float().clone()
    dist.all_reduce(total)
    return total.item() / (dims.dp * dims.cp * dims.tp)


def train(cfg: TrainConfig, info: cdist.DistEnv, device: torch.device) -> int:
    world, rank = info.world_size, info.rank
    dims = ParallelDims(pp=cfg.pp, dp_replicate=cfg.dp_replicate, dp_shard=cfg.dp_shard, cp=cfg.cp, tp=cfg.tp,
                        ep=cfg.ep)
    model = build_llama(cfg.lm_size, seed=cfg.seed, tied=cfg.tied, experts=cfg.experts)  # on every rank, then split
    if cfg.experts and (dims.tp_enabled or dims.pp_enabled):
        raise ValueError("--experts with --tp or --pp is not built here: the experts' weights are one tensor each "
                         "(tensor parallel would split them, expert parallel spreads them), and a pipeline would "
                         "carry each stage's balancing loss; use --dp-shard, --dp-replicate or --cp")
    dims.validate(world, model.shape, cfg.batch_size, cfg.microbatches, cfg.seq_len)
    if dims.ep_enabled and cfg.ckpt_dir:
        raise ValueError("--ep with --ckpt-dir is not built yet: each rank's experts are plain tensors under the "
                         "same names, which torch.distributed.checkpoint would take for copies; leave one out")
    if cfg.float8 and float8_problem(device, dims):
        raise ValueError(float8_problem(device, dims))
    precision, note = fsdp_precision(cfg.precision, resolve_precision(cfg.precision, device), "train_lm.py")
    if note and rank == 0:
        print(note, file=sys.stderr, flush=True)
    mesh = dims.build_mesh(device)
    model.to(device)
    bf16 = torch.bfloat16 if precision == "bf16" else None
    parallelize(model, dims, mesh, ac=cfg.ac, param_dtype=bf16, compile=cfg.compile, float8=cfg.float8,
                seq_len=cfg.seq_len, cp_layout=cfg.cp_layout)
    # FSDP2 casts the gathered weights to bf16 itself; without it, autocast does
    run = Step(model, dims, mesh, cfg, "fp32" if dims.fsdp_enabled else precision, device)
    optimizer = make_optimizer(model, cfg, cfg.lr)
    data = TokenBatches(load_tokens(cfg.text), cfg.seq_len, cfg.batch_size, dims.dp, dims.dp_index(mesh), cfg.seed)

    global_batch = cfg.batch_size * dims.dp
    cp_rank = mesh["cp"].get_local_rank()

    def my_tokens(batch: torch.Tensor) -> torch.Tensor:  # context parallel: this rank's share of each sequence
        return shard(batch, cfg.cp_layout, cp_rank, dims.cp) if dims.cp_enabled else batch
    losses, grad_norms, step, resumed_from = [], [], 0, None
    ckpt = ensure_writable_dir(cfg.ckpt_dir, "checkpoint folder") if cfg.ckpt_dir else None
    saved = latest_sharded(ckpt) if ckpt and cfg.resume else None
    if saved:
        progress = load_sharded(saved, model, optimizer)  # this rank's part, whatever layout wrote it
        # the global batch must stay; how it is dealt to the ranks may change with the layout
        mismatch = [m for m in resume_mismatch(progress["config"], cfg) if not m.startswith("batch_size ")]
        if progress["global_batch"] != global_batch:
            mismatch.append(f"global batch {progress['global_batch']} -> {global_batch} (--batch-size x "
                            "data-parallel ranks)")
        if mismatch:
            raise ValueError(f"{ckpt} was written by another run ({'; '.join(mismatch)}): use a new --ckpt-dir")
        step, losses, grad_norms = progress["step"], progress["losses"], progress["grad_norms"]
        resumed_from = {"path": str(saved), "step": step, "layout": progress["layout"]}
        cdist.print0(f"resumed from {saved} at step {step}, written by {progress['layout']}")

    def save() -> None:
        save_sharded(ckpt, model, optimizer, {"step": step, "losses": losses, "grad_norms": grad_norms,
                                              "global_batch": global_batch, "layout": asdict(dims),
                                              "config": asdict(cfg)})

    tokens_per_step = global_batch * cfg.seq_len
    fpt = flops_per_token(model.shape, cfg.seq_len)
    peak = tensor_core_peak_tflops(device)  # TFLOP/s, None on a CPU
    cdist.print0(f"{cfg.lm_size} decoder, {sum(parameter_counts(model.shape).values()) / 1e6:.2f} M "
                 f"parameters, on {world} rank(s) as {dims}; {tokens_per_step:,} tokens a step, {precision}")
    stop = StopRequest()
    stop.install(signal.SIGUSR1)
    timed_tokens, timed_s, started = 0, 0.0, None
    ring_sent.update(forward=0, backward=0)  # the ring's bytes (context parallel), counted over the steps only
    ring_work.update(seconds=0.0, pairs=0)  # and each rank's attention blocks: their seconds and pairs
    a2a_sent.update(dispatch=0, combine=0)  # the experts' all-to-alls' (expert parallel), likewise
    loads = []  # rank 0's routers: assignments per expert each step, summed over the blocks
    first_step, activation_mib, gradient_mib = step, None, None
    model.train()
    while step < cfg.steps:
        x, y = (my_tokens(t).to(device) for t in data.batch_at(step))
        with SavedForBackward() if step == first_step else contextlib.nullcontext() as saved:
            loss = run.train(x, y)
        if step == first_step:  # what this rank's first step kept for its backward pass, and the gradients it made
            activation_mib = saved.bytes / 2**20
            gradient_mib = local_bytes(p.grad for p in model.parameters()) / 2**20
        if cfg.experts:
            loads.append(router_load(model))
        grad_norms.append(clip_grad_norm(model, CLIP, dims, mesh))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(mean_over_ranks(loss, dims))
        step += 1
        sync(device)
        now = time.perf_counter()
        if started is not None:  # every step after the first (its time is start-up)
            timed_tokens, timed_s = timed_tokens + tokens_per_step, timed_s + now - started
        started = now
        if rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps):
            rate = timed_tokens / timed_s if timed_s else 0.0
            mfu = f", MFU {rate * fpt / world / (peak * 1e12):.1%}" if peak else ""
            print(f"step {step}/{cfg.steps}: loss {losses[-1]:.4f}, {rate:,.0f} tokens/s{mfu}", flush=True)
        if ckpt and cfg.ckpt_every_steps and step % cfg.ckpt_every_steps == 0:
            save()
        if stop.poll():
            cdist.print0(f"stop asked ({stop.reason}) after step {step}: checkpointed, exiting")
            break
    if ckpt:
        save()
    ring = {phase: n / max(step - first_step, 1) for phase, n in ring_sent.items()}  # a step's, this rank's
    a2a = {phase: n / max(step - first_step, 1) for phase, n in a2a_sent.items()}
    steps_run = max(step - first_step, 1)
    attention = {"ms": [1000 * t / steps_run for t in cdist.gathered(ring_work["seconds"])],  # by rank, a step
                 "pairs": [n // steps_run for n in cdist.gathered(ring_work["pairs"])]}

    model.eval()
    vx, vy = (my_tokens(t).to(device) for t in data.validation(VAL_SEQUENCES))
    val = run.evaluate(vx, vy)
    val_loss = mean_over_ranks(val, dims) if val is not None else None
    if val is None and rank == 0:
        print("no held-out loss: this torch's pipeline schedules have no eval()", flush=True)
    rate = timed_tokens / timed_s if timed_s else None
    if device.type != "cuda" and rank == 0:
        print("tokens/s only: MFU needs a GPU's matmul peak (a CPU's varies with its cores, threads and load)",
              flush=True)
    emit_result({"trainer": Path(__file__).name, "world_size": world, "layout": asdict(dims), "device": str(device),
                 "precision": precision, "ac": cfg.ac, "compile": cfg.compile, "steps": step, "losses": losses,
                 "grad_norms": grad_norms, "val_loss": val_loss,
                 "tokens_per_step": tokens_per_step, "tokens_per_s": rate,
                 "tokens_per_s_per_device": rate / world if rate else None, "flops_per_token": fpt,
                 "mfu": rate * fpt / world / (peak * 1e12) if rate and peak else None, "resumed_from": resumed_from,
                 "stopped": stop.reason if stop.code else None, "peak_memory_mib": peak_memory_mib(device),
                 "ring_bytes_per_step": ring if dims.cp_enabled else None,
                 "all_to_all_bytes_per_step": a2a if dims.ep_enabled else None, "expert_load": loads or None,
                 "activation_mib": activation_mib,
                 "state_mib": {"params": local_bytes(model.parameters()) / 2**20, "gradients": gradient_mib,  # this rank's
                               "optimizer": local_bytes(t for s in optimizer.state.values() for t in s.values()
                                                        if torch.is_tensor(t) and t.dim() > 0) / 2**20},
                 "attention_per_step_by_rank": attention if dims.cp_enabled else None})
    return 0


if __name__ == "__main__":
    sys.exit(main())
