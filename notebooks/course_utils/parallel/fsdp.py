"""FSDP2 on the decoder: each transformer block its own unit, then the whole model (the embedding, the final
norm and the head, which a tied model shares with the embedding, in the root's unit)."""

from __future__ import annotations

import torch
from torch import nn


def apply_fsdp(model: nn.Module, dp_mesh, param_dtype: torch.dtype | None = None,
               reshard_after_forward: bool = True, cpu_offload: bool = False, ignored: set | None = None) -> None:
    """Shard ``model`` over ``dp_mesh``: a 1-D mesh shards over all its ranks; a 2-D ``(dp_replicate,
    dp_shard)`` mesh shards within each replica group and all-reduces across them (HSDP). ``param_dtype``:
    the weights are gathered and computed in it (bf16), the gradients reduced in fp32. ``cpu_offload``:
    the shards, their gradients and the optimizer's step live in host memory. ``ignored``: parameters FSDP2
    leaves alone (experts spread by expert parallelism: each rank already holds only its own)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    kwargs = {"mesh": dp_mesh, "mp_policy": MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32),
              "reshard_after_forward": reshard_after_forward, "ignored_params": ignored or None}
    if cpu_offload:
        kwargs["offload_policy"] = CPUOffloadPolicy()
    for block in model.layers.values():
        fully_shard(block, **kwargs)
    # the root's unit: its weights are gathered first and, by default, kept to the end (the head needs them last)
    fully_shard(model, **kwargs)
