"""Tensor parallelism: a layer's weights split over ranks (notebook 09, ``scripts/train_tp.py``).

Megatron-LM's split of a transformer block over t ranks: the first linear layer of each pair is
split by its *output* features (column parallel: each rank computes its own slice of the hidden
units, no communication), the second by its *input* features (row parallel: each rank computes a
partial sum of the output, and one all-reduce adds them). Backward mirrors it: the gradient of the
block's input is a sum over the ranks' slices, one all-reduce. Per block and step: 2 all-reduces
forward (after attention, after the MLP) and 2 backward, each of batch x sequence x hidden values.

:class:`ColumnRowMLP` writes that out by hand for the MLP (Megatron's ``f`` and ``g``);
:func:`megatron_plan` asks DTensor's ``parallelize_module`` for the same on a whole block, and
:class:`CollectiveBytes` counts the bytes DTensor hands to each collective, forward and backward.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


# --------------------------------------------------------------------------- #
# A small transformer block, the model both versions split
# --------------------------------------------------------------------------- #
class Attention(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.head_dim = hidden // heads
        self.q, self.k, self.v, self.o = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        # -1 heads: under tensor parallelism each rank holds heads/t of them (its columns of q, k, v)
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class SwiGLU(nn.Module):
    """Llama's MLP: ``down(silu(gate(x)) * up(x))``, hidden -> 4 x hidden -> hidden, no biases
    (notebook 09's exercise splits it with a plan of its own)."""

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(hidden, 4 * hidden, bias=False), nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    """Pre-norm transformer block: x + attention(norm(x)), then x + MLP(norm(x))."""

    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.attn = nn.LayerNorm(hidden), Attention(hidden, heads)
        self.ln2, self.mlp = nn.LayerNorm(hidden), MLP(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


def build_blocks(hidden: int, heads: int, blocks: int, seed: int = 0) -> nn.Sequential:
    """The same weights on every rank (``seed``), before any split."""
    torch.manual_seed(seed)
    return nn.Sequential(*[Block(hidden, heads) for _ in range(blocks)])


# --------------------------------------------------------------------------- #
# By hand: Megatron-LM's f and g around a column- then row-parallel MLP
# --------------------------------------------------------------------------- #
class CopyToParallel(torch.autograd.Function):
    """Megatron's ``f``: forward, every rank uses the whole input; backward, the input's gradient is
    the sum of every rank's part (each rank saw only its own columns): all-reduce."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class ReduceFromParallel(torch.autograd.Function):
    """Megatron's ``g``: forward, add the ranks' partial outputs (all-reduce); backward, each rank's
    part gets the whole gradient, as it is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any = None) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnRowMLP(nn.Module):
    """This rank's share of ``dense`` (an :class:`MLP`): fc1's rows (output features) ``rank``/``ranks``,
    fc2's matching columns (input features), fc2's bias once, after the sum. ``group``: the
    tensor-parallel ranks (default: all)."""

    def __init__(self, dense: MLP, rank: int, ranks: int, group: Any = None) -> None:
        super().__init__()
        self.group = group
        inner = dense.fc1.out_features
        if inner % ranks:
            raise ValueError(f"{inner} hidden units do not split evenly over {ranks} ranks")
        cols = slice(rank * inner // ranks, (rank + 1) * inner // ranks)
        self.w1 = nn.Parameter(dense.fc1.weight.detach()[cols].clone())
        self.b1 = nn.Parameter(dense.fc1.bias.detach()[cols].clone())
        self.w2 = nn.Parameter(dense.fc2.weight.detach()[:, cols].clone())
        self.b2 = nn.Parameter(dense.fc2.bias.detach().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = CopyToParallel.apply(x, self.group)
        partial = F.linear(F.gelu(F.linear(x, self.w1, self.b1)), self.w2)  # this rank's part of the sum
        return ReduceFromParallel.apply(partial, self.group) + self.b2


# --------------------------------------------------------------------------- #
# With DTensor: the same split as a plan
# --------------------------------------------------------------------------- #
def megatron_plan(blocks: int, sum_input_grads: bool = True) -> dict[str, Any]:
    """``parallelize_module``'s plan for :func:`build_blocks`: q, k, v, fc1 column-parallel, o and fc2
    row-parallel. ``sum_input_grads``: the attention's and the MLP's inputs enter as DTensors
    (``PrepareModuleInput(..., use_local_output=False)``), so the gradients that q, k and v send back
    to their shared input are added before the one all-reduce; without it, each of the three
    column-parallel layers all-reduces its own (2 more all-reduces per block, backward)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

    plan: dict[str, Any] = {}
    for i in range(blocks):
        plan.update({f"{i}.attn.q": ColwiseParallel(), f"{i}.attn.k": ColwiseParallel(),
                     f"{i}.attn.v": ColwiseParallel(), f"{i}.attn.o": RowwiseParallel(),
                     f"{i}.mlp.fc1": ColwiseParallel(), f"{i}.mlp.fc2": RowwiseParallel()})
        if sum_input_grads:
            for part in ("attn", "mlp"):
                plan[f"{i}.{part}"] = PrepareModuleInput(input_layouts=(Replicate(),),
                                                         desired_input_layouts=(Replicate(),),
                                                         use_local_output=False)
    return plan


def sequence_parallel_plan(blocks: int) -> dict[str, Any]:
    """:func:`megatron_plan` with sequence parallelism (Korthikanti et al., 2022; torch's ``SequenceParallel``):
    between the tensor-parallel regions the activations (the residual stream, the layer norms) stay split
    by sequence over the ranks. Each region's input is all-gathered (``PrepareModuleInput``: a shard of the
    sequence in, the whole sequence out) and the row-parallel layer reduce-scatters its output by sequence
    instead of all-reducing it. The blocks then take and return this rank's slice of the sequence."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    plan: dict[str, Any] = {}
    for i in range(blocks):
        for norm, part, first, second in (("ln1", "attn", ("q", "k", "v"), "o"), ("ln2", "mlp", ("fc1",), "fc2")):
            plan[f"{i}.{norm}"] = SequenceParallel()
            plan[f"{i}.{part}"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan.update({f"{i}.{part}.{name}": ColwiseParallel() for name in first})
            plan[f"{i}.{part}.{second}"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


def wire_bytes(op: str, handed: int, ranks: int) -> float:
    """Bytes each rank sends for a collective handed ``handed`` bytes per rank, by the ring algorithm
    (notebook 02): an all-reduce sends 2(t-1)/t of its tensor, a reduce-scatter (t-1)/t of its input,
    an all-gather t-1 times its input (each rank's shard goes round the other t-1)."""
    share = {"all_reduce": 2 * (ranks - 1) / ranks, "allreduce": 2 * (ranks - 1) / ranks,
             "reduce_scatter_tensor": (ranks - 1) / ranks, "all_gather_into_tensor": ranks - 1}
    if op not in share:
        raise ValueError(f"no ring formula for {op}: one of {', '.join(share)}")
    return handed * share[op]


class SavedActivations:
    """Counts the bytes autograd saves for the backward pass inside it, parameters left out: the
    activation memory of a forward pass on this rank (a DTensor counted by its local shard)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {(p.to_local() if hasattr(p, "to_local") else p).data_ptr() for p in model.parameters()}
        self.seen: set[int] = set()
        self.bytes = 0

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        local = t.to_local() if hasattr(t, "to_local") else t
        key = local.data_ptr()
        if key not in self.params and key not in self.seen:  # a tensor saved twice is held once
            self.seen.add(key)
            self.bytes += local.numel() * local.element_size()
        return t

    def __enter__(self) -> SavedActivations:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def average_over(group: Any, model: nn.Module, ranks: int) -> None:
    """Data parallelism by hand over ``group``: every gradient (a DTensor's local shard, or a whole tensor)
    all-reduced and divided by the ``ranks`` that computed it, as DDP does."""
    for param in model.parameters():
        if param.grad is not None:
            grad = param.grad.to_local() if hasattr(param.grad, "to_local") else param.grad
            dist.all_reduce(grad, group=group)
            grad /= ranks


def allreduce_theory(batch: int, seq: int, hidden: int, blocks: int, element_bytes: int = 4) -> dict[str, int]:
    """All-reduces and the bytes handed to them per training step, Megatron's split: 2 per block forward,
    2 backward, each of batch x seq x hidden values."""
    one = batch * seq * hidden * element_bytes
    return {"forward_calls": 2 * blocks, "backward_calls": 2 * blocks,
            "forward_bytes": 2 * blocks * one, "backward_bytes": 2 * blocks * one}


COLLECTIVES = ("all_reduce", "allreduce", "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single",
               "broadcast")


class CollectiveBytes(TorchDispatchMode):
    """Counts the collectives run inside it and the bytes of the tensor each one is given, by name
    (DTensor's redistributions reach the dispatcher as torch's functional collectives)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = defaultdict(int)
        self.bytes: dict[str, int] = defaultdict(int)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        from torch.distributed.tensor import DTensor

        if any(t is DTensor for t in types):
            return NotImplemented  # let DTensor turn it into plain ops (and collectives) first
        out = func(*args, **(kwargs or {}))
        qualified = getattr(getattr(func, "_overloadpacket", None), "_qualified_op_name", "")
        namespace, _, op = qualified.partition("::")
        op = op.rstrip("_")  # c10d's in-place names end in _
        if namespace in ("_c10d_functional", "c10d") and op in COLLECTIVES and isinstance(args[0], torch.Tensor):
            self.calls[op] += 1
            self.bytes[op] += args[0].numel() * args[0].element_size()
        return out
