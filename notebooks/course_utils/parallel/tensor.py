"""Tensor and sequence parallelism on the decoder: Megatron-LM's split as DTensor plans (torchtitan's).

In each block, ``wq``, ``wk``, ``wv`` and SwiGLU's ``w1``, ``w3`` are column parallel (each rank computes its
heads and its slice of the hidden units, no communication) and ``wo``, ``w2`` row parallel (partial sums,
reduce-scattered by sequence). Between them, the norms and the residual stream are sequence parallel: each
rank holds ``seq / tp`` of the tokens, and each region's input is all-gathered. The embedding is split by
rows of the vocabulary; the head by its outputs, and with ``loss_parallel`` the cross-entropy is computed on
the vocabulary shards, never gathering the logits (batch x seq x vocab values).
"""

from __future__ import annotations

from typing import Any

from torch import nn


def block_plan() -> dict[str, Any]:
    """One transformer block's plan, its names relative to the block."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
    )

    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"attention_norm": SequenceParallel(), "attention": gather,
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(), "feed_forward": gather,
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1))}


def outer_plan(loss_parallel: bool = True) -> dict[str, Any]:
    """The embedding, the final norm and the head. ``loss_parallel``: the logits stay split by vocabulary
    (a DTensor) for ``torch.distributed.tensor.parallel.loss_parallel``; else they are gathered."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

    return {"tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "norm": SequenceParallel(),
            "output": ColwiseParallel(input_layouts=Shard(1),
                                      output_layouts=Shard(-1) if loss_parallel else Replicate(),
                                      use_local_output=not loss_parallel)}


def apply_tp(model: nn.Module, tp_mesh, loss_parallel: bool = True) -> None:
    """Split ``model`` (a :class:`course_utils.llama.Llama`) over ``tp_mesh``."""
    from torch.distributed.tensor.parallel import parallelize_module

    # a pipeline stage holds the embedding or the head only where it is first or last
    plan = {name: style for name, style in outer_plan(loss_parallel).items() if getattr(model, name) is not None}
    parallelize_module(model, tp_mesh, plan)
    for block in model.layers.values():
        parallelize_module(block, tp_mesh, block_plan())
