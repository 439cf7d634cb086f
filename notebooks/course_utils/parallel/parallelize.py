"""``parallelize(model, dims, mesh)``: every parallelism of :class:`ParallelDims` applied in torchtitan's
order: the pipeline's cut first (this rank keeps its stage), then tensor parallel (it rewrites the layers'
weights as DTensors), then activation checkpointing (it wraps whole blocks), then FSDP2 (it shards what the
others left, per block). ``clip_grad_norm`` clips by the norm over every shard, rank and stage."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .checkpointing import apply_ac
from .dims import ParallelDims
from .fsdp import apply_fsdp
from .pipeline import cut
from .tensor import apply_tp


def parallelize(model: nn.Module, dims: ParallelDims, mesh, ac: str = "none", param_dtype: torch.dtype | None = None,
                loss_parallel: bool = True, cpu_offload: bool = False) -> nn.Module:
    if dims.pp_enabled:
        cut(model, dims.pp, mesh["pp"].get_local_rank())
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    apply_ac(model, ac)
    if dims.fsdp_enabled:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
        # a pipeline runs each stage's forward once per micro-batch: keep the gathered weights between them
        apply_fsdp(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=not dims.pp_enabled,
                   cpu_offload=cpu_offload)
    return model


def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims, mesh) -> float:
    """Clip ``model``'s gradients to ``max_norm`` by their norm over the whole model, and return that norm
    (before clipping): the same number in every layout. DTensor sums the squares over the shards of FSDP2 and
    tensor parallel; the stages' squares are summed across the pipeline here."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    if dims.pp_enabled:
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=mesh["pp"].get_group())
        norm = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
    return norm.item()
