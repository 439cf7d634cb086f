"""``parallelize(model, dims, mesh)``: every parallelism of :class:`ParallelDims` applied in torchtitan's
order: tensor parallel first (it rewrites the layers' weights as DTensors), then activation checkpointing
(it wraps whole blocks), then FSDP2 (it shards what the others left, per block)."""

from __future__ import annotations

import torch
from torch import nn

from .checkpointing import apply_ac
from .dims import ParallelDims
from .fsdp import apply_fsdp
from .tensor import apply_tp


def parallelize(model: nn.Module, dims: ParallelDims, mesh, ac: str = "none", param_dtype: torch.dtype | None = None,
                loss_parallel: bool = True, reshard_after_forward: bool = True, cpu_offload: bool = False) -> nn.Module:
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    apply_ac(model, ac)
    if dims.fsdp_enabled:
        dp_mesh = mesh["dp_replicate", "dp_shard"] if dims.hsdp_enabled else mesh["dp_shard"]
        apply_fsdp(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=reshard_after_forward,
                   cpu_offload=cpu_offload)
    return model
