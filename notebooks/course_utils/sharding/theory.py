"""ZeRO's theory (Rajbhandari et al. 2020): the bytes each rank holds per stage, what each stage sends, what
DeepSpeed's collectives send instead, and the bytes a ring sends for each collective."""

from __future__ import annotations

from ..collectives import bytes_sent_per_rank


STAGES = (0, 1, 2, 3)
PARTS = ("params", "gradients", "optimizer")
# what each stage shards across the ranks (the rest every rank holds whole)
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "params")}


def model_state_bytes(parts: dict[str, float]) -> float:
    """Weights + gradients + optimizer state: the model state ZeRO shards (``parts`` keyed by :data:`PARTS`)."""
    return sum(parts[p] for p in PARTS)


def bytes_per_param(precision: str, optimizer: str = "adamw", momentum: float = 0.9) -> dict[str, int]:
    """Bytes of each part of the model state per parameter, unsharded.

    Mixed precision (bf16, fp16): 2-byte weights and gradients, and the optimizer keeps an fp32
    master copy (4) besides its moments. fp32: 4-byte weights and gradients, no master copy.
    Moments: AdamW 8 (two fp32 tensors), SGD with momentum 4, plain SGD 0.
    """
    moments = 8 if optimizer == "adamw" else (4 if momentum > 0 else 0)
    if precision == "fp32":
        return {"params": 4, "gradients": 4, "optimizer": moments}
    return {"params": 2, "gradients": 2, "optimizer": 4 + moments}


def zero_theory(psi: int, ranks: int, stage: int, precision: str = "bf16", optimizer: str = "adamw",
                momentum: float = 0.9) -> dict[str, float]:
    """Bytes of params, gradients and optimizer state one rank holds under ZeRO ``stage``."""
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, not {stage!r}")
    per = bytes_per_param(precision, optimizer, momentum)
    return {part: per[part] * psi / (ranks if part in SHARDED[stage] else 1) for part in PARTS}


def comm_theory(psi: int, ranks: int, stage: int, precision: str = "bf16", grad_accum: int = 1) -> float:
    """Bytes one rank sends per optimizer step with ring collectives (a reduce-scatter or an all-gather
    moves (N-1)/N of the full buffer per rank, an all-reduce twice that), for ``grad_accum`` micro-batches.

    Stages 0 and 1 reduce the accumulated gradients once per step (an all-reduce, or stage 1's
    reduce-scatter and all-gather of the updated weights): 2 Psi elements. Stage 2 reduce-scatters the
    gradients of every micro-batch (each rank keeps only its shard, so it cannot accumulate the whole)
    and all-gathers the updated weights once: (grad_accum + 1) Psi. Stage 3 also all-gathers every
    weight in each micro-batch's forward and backward pass: 3 Psi per micro-batch.
    """
    element = 4 if precision == "fp32" else 2
    passes = {0: 2, 1: 2, 2: grad_accum + 1, 3: 3 * grad_accum}[stage]
    return passes * psi * element * (ranks - 1) / ranks


def deepspeed_comm(psi: int, ranks: int, stage: int, precision: str = "bf16", grad_accum: int = 1) -> dict[str, float]:
    """Bytes one rank sends per optimizer step in each collective DeepSpeed 0.19 runs for ZeRO ``stage`` with the
    course's configuration (:func:`ds_config`), by the name its comms logger gives it: where :func:`comm_theory`
    counts the paper's collectives, this counts DeepSpeed's (read in deepspeed/runtime/).

    Every collective carries the weights' dtype: ``communication_data_type`` defaults to bf16 or fp16 when the
    weights are (fp32 otherwise, engine.py:1719-1730), and so does the dtype gradients accumulate in
    (get_data_types, engine.py:1799-1810). Stage 0 all-reduces the accumulated gradients once per step
    (allreduce_bucket, engine.py:3795-3821). Stages 1 and 2 all-reduce each bucket of gradients and keep their
    part of it (use_multi_rank_bucket_allreduce, on by default, zero/stage_1_and_2.py:1695-1711), 2 Psi per
    reduction where the paper's reduce-scatter sends Psi: stage 1 at the step, stage 2 every micro-batch; then
    both all-gather the updated weights once (all_gather_dp_groups, utils.py:1008-1016). Stage 3, set by
    :func:`ds_config` to free each weight after use, does what the paper says: it all-gathers the weights in
    each micro-batch's forward and again in its backward pass (zero/partition_parameters.py:1540-1601) and
    reduce-scatters the gradients (zero/stage3.py:1912-1931, runtime/comm/coalesced_collectives.py:81-130).
    """
    if stage not in STAGES:
        raise ValueError(f"ZeRO stage must be one of {STAGES}, not {stage!r}")
    ring = psi * (4 if precision == "fp32" else 2) * (ranks - 1) / ranks  # one reduce-scatter or all-gather of Psi
    return {0: {"all_reduce": 2 * ring},
            1: {"all_reduce": 2 * ring, "all_gather_into_tensor": ring},
            2: {"all_reduce": 2 * grad_accum * ring, "all_gather_into_tensor": ring},
            3: {"all_gather_into_tensor": 2 * grad_accum * ring, "reduce_scatter_tensor": grad_accum * ring}}[stage]


# How a ring sends each collective, by the name DeepSpeed's comms logger gives it: its kind (the share of the
# whole buffer each rank sends: collectives.BUS_FACTORS), and whether the tensor a call is given, which the
# logger and C10dCollectives measure, is this rank's shard (the all-gathers) or the whole buffer (the rest)
_RING = {"all_reduce": ("all_reduce", False), "all_reduce_coalesced": ("all_reduce", False),
         "inference_all_reduce": ("all_reduce", False), "reduce": ("reduce", False),
         "broadcast": ("broadcast", False), "all_gather": ("all_gather", True),
         "all_gather_into_tensor": ("all_gather", True), "reduce_scatter": ("reduce_scatter", False),
         "reduce_scatter_tensor": ("reduce_scatter", False)}


def sent_per_rank(op: str, input_bytes: float, ranks: int) -> float:
    """Bytes one rank sends in the ring collective ``op`` whose input is ``input_bytes``: (N-1)/N of the whole
    buffer for a reduce-scatter or an all-gather, twice that for an all-reduce. The whole buffer is the input
    of an all-reduce or a reduce-scatter, and N inputs of an all-gather, whose input is this rank's shard.
    (Taking a reduce-scatter's input for a shard counts N times what it sends.)"""
    if op not in _RING:
        raise ValueError(f"no ring factor for the collective {op!r}: add it to course_utils.sharding.theory._RING")
    kind, shard = _RING[op]
    return bytes_sent_per_rank(kind, input_bytes * ranks if shard else input_bytes, ranks)


def no_offload_per_gpu(table: str) -> float:
    """Bytes per GPU in the no-offload row of the table that one of DeepSpeed's
    ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` prints (``per CPU | per GPU | Options``; for stage 3
    the row with ``zero_init=1``, weights built already sharded)."""
    for line in table.splitlines():
        cells = [cell.strip() for cell in line.split("|")]
        if len(cells) == 3 and cells[2].endswith(("offload_optimizer=none", "offload_optimizer=none, zero_init=1")):
            return float(cells[1].removesuffix("GB")) * 2**30
    raise ValueError(f"no row without offload in DeepSpeed's estimate (has its table changed?):\n{table}")
