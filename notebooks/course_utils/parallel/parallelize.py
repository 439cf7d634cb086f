"""``parallelize(model, dims, mesh)``: every parallelism of :class:`ParallelDims` applied in torchtitan's
order: the pipeline's cut first (this rank keeps its stage), then float8 (it swaps the Linear layers), then
tensor parallel (it rewrites the layers' weights as DTensors), then context parallel (attention round a ring),
then activation checkpointing (it wraps whole
blocks), then ``torch.compile`` per block (each block the same graph, compiled once), then FSDP2 (it shards
what the others left, per block). ``clip_grad_norm`` clips by the norm over every shard, rank and stage."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .checkpointing import apply_ac
from .context import apply_cp
from .experts import MoE, apply_ep, expert_params
from .dims import ParallelDims
from .fsdp import apply_fsdp
from .pipeline import cut
from .tensor import apply_tp


FLOAT8_CC = (8, 9)  # float8 tensor cores: Ada (L4, RTX 40xx) and Hopper (H100) on


def float8_problem(device: torch.device, dims: ParallelDims) -> str | None:
    """Why float8 training cannot run here, in one line (None: it can)."""
    if device.type != "cuda" or torch.cuda.get_device_capability(device) < FLOAT8_CC:
        cc = "a CPU" if device.type != "cuda" else "compute capability %d.%d" % torch.cuda.get_device_capability(device)
        return (f"--float8 needs float8 tensor cores (compute capability 8.9+: L4, H100); this device has {cc}: "
                "leave it out (bf16 is the fastest format here)")
    if dims.tp_enabled:
        return "--float8 with --tp needs torchao's float8 tensor-parallel plans, which this course does not apply"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "--float8 needs torchao: pip install torchao (then rerun)"
    return None


def apply_float8(model: nn.Module) -> None:
    """Every Linear layer but the head trains in float8 with dynamic scales (torchao; the head's vocabulary-wide
    outputs stay in bf16, as torchtitan leaves them)."""
    from torchao.float8 import convert_to_float8_training

    convert_to_float8_training(model, module_filter_fn=lambda module, fqn: fqn != "output")


def parallelize(model: nn.Module, dims: ParallelDims, mesh, ac: str = "none", param_dtype: torch.dtype | None = None,
                loss_parallel: bool = True, cpu_offload: bool = False, compile: bool = False,
                float8: bool = False, seq_len: int | None = None, cp_layout: str = "zigzag") -> nn.Module:
    if dims.pp_enabled:
        cut(model, dims.pp, mesh["pp"].get_local_rank())
    if float8:  # GPUs with fp8 matmuls (compute capability 8.9 on: H100), through torchao
        apply_float8(model)
    if dims.tp_enabled:
        apply_tp(model, mesh["tp"], loss_parallel=loss_parallel)
    if dims.cp_enabled:  # notebook 12: the sequence split over cp, ring attention
        apply_cp(model, mesh["cp"], seq_len, cp_layout)
    if dims.ep_enabled:  # notebook 12: the experts spread over dp_shard's ranks
        for moe in [m for m in model.modules() if isinstance(m, MoE)]:
            apply_ep(moe, mesh["dp_shard"])
    apply_ac(model, ac)
    if compile:
        for block in model.layers.values():
            block.compile()  # in place: the parameters keep their names (checkpoints stay layout-free)
    if dims.fsdp_enabled:
        dp_mesh = dims.fsdp_mesh(mesh)
        # a pipeline runs each stage's forward once per micro-batch: keep the gathered weights between them
        apply_fsdp(model, dp_mesh, param_dtype=param_dtype, reshard_after_forward=not dims.pp_enabled,
                   cpu_offload=cpu_offload, ignored=set(expert_params(model)))
    return model


def clip_grad_norm(model: nn.Module, max_norm: float, dims: ParallelDims, mesh) -> float:
    """Clip ``model``'s gradients to ``max_norm`` by their norm over the whole model, and return that norm
    (before clipping): the same number in every layout. DTensor sums the squares over the shards of FSDP2 and
    tensor parallel; the stages' squares are summed across the pipeline here."""
    spread = set(expert_params(model))  # each ep rank holds other experts: their squares summed over the ranks
    params = [p for p in model.parameters() if p.grad is not None and p not in spread]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    squared = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm).float() ** 2
    if spread:
        experts = torch.nn.utils.get_total_norm([p.grad for p in spread]).float() ** 2
        dist.all_reduce(experts, group=mesh["dp_shard"].get_group())
        squared = squared + experts
    if dims.pp_enabled:
        dist.all_reduce(squared, group=mesh["pp"].get_group())
    norm = squared.sqrt()
    for group in (params, list(spread)):  # sharded DTensors and plain tensors: clipped apart
        if group:
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm.item()
