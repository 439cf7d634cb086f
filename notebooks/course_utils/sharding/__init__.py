"""Sharded data parallelism (notebook 07): DeepSpeed ZeRO and PyTorch FSDP2, measured against the theory.

The theory (Rajbhandari et al. 2020, "ZeRO"): every rank of plain data parallelism holds the
whole model state. For Psi parameters trained with Adam in mixed precision that is 2 Psi bytes of
bf16 weights, 2 Psi of bf16 gradients and 12 Psi of optimizer state (an fp32 master copy of the
weights, Adam's two moments). ZeRO stage 1 shards the optimizer state across the N ranks, stage 2
also the gradients, stage 3 also the weights (:func:`zero_theory`). The price is communication:
stages 0-2 move what an all-reduce of the gradients moves, stage 3 also all-gathers the weights
in the forward and again in the backward pass (:func:`comm_theory`). DeepSpeed's collectives differ
from the paper's in places (:func:`deepspeed_comm`); what they send is counted twice, by DeepSpeed's
comms logger and at torch's dispatcher (:class:`C10dCollectives`), and read as a ring sends it
(:func:`sent_per_rank`).

What a rank holds is measured from the tensors DeepSpeed and FSDP2 keep (:func:`zero_memory`,
:func:`fsdp_memory`), and on a GPU from the allocator too. Helpers for the two scripts,
``scripts/train_deepspeed.py`` and ``scripts/train_fsdp.py``, live here as well; their sharded checkpoints
(and the tensor- and pipeline-parallel scripts') are ``course_utils.checkpoint``'s.

In three modules: ``theory`` (bytes and collectives per stage), ``scripts`` (what the two scripts share, DeepSpeed's
environment and ``ds_config``), ``measure`` (what a rank holds and sends); everything is imported here.
"""


from .theory import (  # noqa: F401
    STAGES,
    PARTS,
    SHARDED,
    bytes_per_param,
    model_state_bytes,
    zero_theory,
    comm_theory,
    deepspeed_comm,
    sent_per_rank,
    no_offload_per_gpu,
)
from .scripts import (  # noqa: F401
    add_sharding_args,
    start_rank,
    shard_units,
    fsdp_precision,
    deepspeed_env,
    deepspeed_device_env,
    ds_config,
    warm_deepspeed_ops,
)
from .measure import (  # noqa: F401
    zero_gradient_bytes,
    zero_memory,
    C10dCollectives,
    per_step,
    start_counting_collectives,
    stop_counting_collectives,
    _fsdp_param_groups,
    fsdp_gradient_bytes,
    fsdp_memory,
    local_bytes,
)
