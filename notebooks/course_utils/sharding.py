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
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch

from .collectives import bytes_sent_per_rank
from .config import TrainConfig, unsupported
from .devices import PlacementError
from .process_group import DistEnv, RendezvousError, free_port, init_distributed
from .models import CHECKPOINTABLE
from .precision import resolve_precision
from .tensor_parallel import CollectiveBytes

STAGES = (0, 1, 2, 3)
PARTS = ("params", "gradients", "optimizer")
# what each stage shards across the ranks (the rest every rank holds whole)
SHARDED = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "params")}


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
        raise ValueError(f"no ring factor for the collective {op!r}: add it to course_utils.sharding._RING")
    kind, shard = _RING[op]
    return bytes_sent_per_rank(kind, input_bytes * ranks if shard else input_bytes, ranks)


# --------------------------------------------------------------------------- #
# What train_deepspeed.py and train_fsdp.py share
# --------------------------------------------------------------------------- #
def add_sharding_args(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """A flag group ``title`` with the options both sharded scripts take; the caller adds its own."""
    group = parser.add_argument_group(title)
    group.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute activations in the backward pass (--model mlp)")
    group.add_argument("--gradient-clipping", type=float, default=1.0, help="max gradient norm (default: 1.0)")
    return group


def start_rank(cfg: TrainConfig, script: str, left_out: set[str],
               activation_checkpointing: bool = False) -> tuple[DistEnv, torch.device, str]:
    """Join the run's process group through the course's door (``dist.init_distributed``: one GPU per
    rank, ``set_device`` and ``device_id`` before the group exists, GPU binding understood) and return
    who this rank is, its device and its precision. One line and exit 1 when ``cfg`` asks for what
    ``script`` leaves out, for a layout the node cannot hold, or for activation checkpointing of a
    model not written for it. With one process the group is a group of one."""
    try:
        unsupported(cfg, script, left_out)
        if activation_checkpointing and cfg.model not in CHECKPOINTABLE:
            raise ValueError(f"--activation-checkpointing is written for --model {' or '.join(CHECKPOINTABLE)}")
        info, device = init_distributed(cfg.device, group_of_one=True)  # ZeRO and FSDP2 need a group, even of one
        return info, device, resolve_precision(cfg.precision, device)
    except (ValueError, PlacementError, RendezvousError) as exc:
        sys.exit(f"error: {exc}")


def fsdp_precision(requested: str, resolved: str) -> tuple[str, str]:
    """The precision train_fsdp.py runs in, and a one-line note when it is not what was asked.

    FSDP2 here computes in bf16 or fp32. fp16 would need a gradient scaler over sharded
    gradients; on a GPU without bf16 (Frontera's RTX 5000) ``amp`` resolves to fp16, and the run
    falls back to fp32 and says so; ``--precision fp16`` asked for by name is refused.
    """
    if resolved != "fp16":
        return resolved, ""
    if requested == "amp":
        return "fp32", ("note: this GPU has no bf16 and train_fsdp.py does not train in fp16 (that needs a sharded "
                        "gradient scaler): running in fp32")
    raise ValueError("train_fsdp.py trains in fp32 or bf16 (fp16 would need a sharded gradient scaler): use "
                     "--precision bf16 on Ampere or newer, fp32 (or amp) on older GPUs, or train_deepspeed.py, "
                     "whose fp16 has loss scaling")


# --------------------------------------------------------------------------- #
# DeepSpeed
# --------------------------------------------------------------------------- #
def deepspeed_env(use_gpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set before ``import deepspeed`` (returned, not set): the accelerator
    (DeepSpeed picks it when imported), where its C++ ops are built (once per Python environment,
    ``sys.prefix/torch_extensions``, not in a home folder shared by every environment and torch
    version), and outside a launcher those of a one-process group. Only what ``environ`` lacks,
    and ``PATH`` with this environment's ``bin`` first where it is not.

    ``PATH``: torch builds the ops with the first ``ninja`` on it, and the environment's own (pip's,
    DeepSpeed's dependency) and a system one (Debian's ninja-build) hash their command lines
    differently: each rebuilt what the other had built, 40-140 s a time on this course's CI machine,
    every time a Slurm job (an activated environment) and a plain ``python`` took turns.

    A script sets them in its own process (``os.environ.update``); a notebook kernel sets them only
    around its import (``launch.temporary_env``), so that no later script inherits them.
    """
    environ = os.environ if environ is None else environ
    wanted = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
    if not use_gpu:
        wanted["DS_ACCELERATOR"] = "cpu"
    if "WORLD_SIZE" not in environ:  # plain `python script.py`: a group of one (DeepSpeed would look for MPI)
        wanted.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    missing = {k: v for k, v in wanted.items() if k not in environ}
    env_bin, path = str(Path(sys.executable).parent), environ.get("PATH", "")
    if path.split(os.pathsep)[0] != env_bin:
        missing["PATH"] = os.pathsep.join([env_bin, *(p for p in path.split(os.pathsep) if p and p != env_bin)])
    return missing


def deepspeed_device_env(device: torch.device, environ: Mapping[str, str]) -> dict[str, str]:
    """``LOCAL_RANK`` as DeepSpeed must read it (returned, not set): ``deepspeed.initialize`` (and ZeRO-3's
    ``Init``) calls ``set_device(int(LOCAL_RANK))`` itself, after the course placed this rank on ``device``.
    Where Slurm binds a GPU to each task, that is every task's ``cuda:0`` while ``LOCAL_RANK`` is the task's
    place on its node: DeepSpeed would ask for a GPU the task cannot see ("invalid device ordinal")."""
    if device.type != "cuda" or device.index is None or environ.get("LOCAL_RANK") == str(device.index):
        return {}
    return {"LOCAL_RANK": str(device.index)}


def ds_config(cfg: TrainConfig, world: int, stage: int, precision: str, offload: bool = False,
              clip: float = 1.0, bucket_elements: int = 2_000_000, use_gpu: bool = False) -> dict[str, Any]:
    """The DeepSpeed configuration of a course run (notebook 07 explains it field by field)."""
    zero: dict[str, Any] = {
        "stage": stage,
        # buckets of gradients reduced (and of weights gathered) at once, in elements: DeepSpeed's
        # default 5e8 would allocate a 1 GB bf16 buffer for a 4 M-parameter model
        "reduce_bucket_size": bucket_elements,
        "allgather_bucket_size": bucket_elements,
    }
    if stage == 3:
        zero.update({
            # every weight is sharded, however small (the default keeps those under 1e5 whole)
            "stage3_param_persistence_threshold": 0,
            # and gathered just before its layer runs, then freed, in the forward and again in the backward
            # pass, as the paper's stage 3. DeepSpeed's defaults keep a gathered weight whole while it is used
            # again within 1e9 elements (max_reuse_distance, zero/partitioned_param_coordinator.py:653-662) or
            # its prefetcher reached its next use while it was still whole (5e7 elements, lines 452-471,
            # 646-651): for this 4 M-parameter model, every weight from its forward to its backward pass
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        })
    if offload:
        # the fp32 master weights, the moments and the optimizer step move to the CPU's memory
        # page-locked on a GPU node: the copies to and from the GPU then run at full PCIe speed
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    return {
        # the global batch: per-rank batch x accumulation x ranks (DeepSpeed checks the product)
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world,
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        # bf16: weights and gradients in bf16, an fp32 master copy in the optimizer; fp16 adds loss scaling
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16", "initial_scale_power": 12},
        "gradient_clipping": clip,
        "zero_optimization": zero,
        # the course's own optimizer (make_optimizer) runs on the offloaded state, where DeepSpeed
        # would otherwise insist on its CPU Adam (a C++ op built on first use)
        "zero_force_ds_cpu_optimizer": False,
        # ZeRO was tested by DeepSpeed with Adam-like optimizers; the course's SGD works too, when allowed
        "zero_allow_untested_optimizer": True,
        # counts every collective DeepSpeed calls (read back by stop_counting_collectives). It also waits
        # for each collective to finish, so the script counts only during the untimed first steps
        # and then switches it off: images/s is measured without it.
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        "steps_per_print": 10**9,  # the course prints its own progress
    }


def _nbytes(tensors: Iterable[Any]) -> int:
    """Bytes of the distinct tensors among ``tensors`` (views of one buffer counted once each)."""
    seen: dict[tuple[int, int], int] = {}
    for t in tensors:
        if torch.is_tensor(t) and t.numel():
            seen[(t.data_ptr(), t.numel())] = t.numel() * t.element_size()
    return sum(seen.values())


def _tensors_in(value: Any) -> list[torch.Tensor]:
    """Tensors in a tensor, or a list/tuple/dict of them, nested."""
    if torch.is_tensor(value):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors_in(v)]
    return []


# Where each DeepSpeed optimizer keeps this rank's fp32 master weights: the whole copy (stage 0 in
# bf16/fp16), this rank's flat partition (stages 1-2), its flat partition (stage 3).
_MASTER_ATTRS = ("fp32_groups", "single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")


def zero_gradient_bytes(engine: Any, optimizer: Any) -> int:
    """Bytes of gradients this rank holds after ``engine.backward`` (before ``engine.step``): the
    weights' ``.grad`` where they are kept whole, the partition ZeRO reduced them into where not
    (with offload: the ``.grad`` of the fp32 shard in CPU memory)."""
    grads = [p.grad for p in engine.module.parameters()]
    grads += _tensors_in(getattr(optimizer, "averaged_gradients", None))
    # with the optimizer offloaded, the reduced gradients go straight to its fp32 shard on the CPU
    grads += [t.grad for t in _masters(optimizer)]
    return _nbytes(grads)


def _masters(optimizer: Any) -> list[torch.Tensor]:
    return next((_tensors_in(getattr(optimizer, a)) for a in _MASTER_ATTRS if hasattr(optimizer, a)), [])


def zero_memory(engine: Any, optimizer: Any, gradient_bytes: int) -> dict[str, Any]:
    """Bytes of params, gradients and optimizer state this rank holds, from DeepSpeed's tensors.

    Params: each weight, or under stage 3 its shard (``ds_tensor``). Optimizer: the fp32 master
    weights DeepSpeed keeps (:data:`_MASTER_ATTRS`) and the optimizer's moments. Gradients: measured
    after a backward pass by :func:`zero_gradient_bytes`.
    """
    params = _nbytes(getattr(p, "ds_tensor", p) for p in engine.module.parameters())
    inner = getattr(optimizer, "optimizer", optimizer)
    state = [t for s in inner.state.values() for t in _tensors_in(s) if t.dim() > 0]  # not step counters
    masters = _masters(optimizer)
    where = {t.device.type for t in state + masters} or {"none"}
    return {"params": params, "gradients": gradient_bytes, "optimizer": _nbytes(state + masters),
            "optimizer_device": ",".join(sorted(where))}


class C10dCollectives(CollectiveBytes):
    """Notebook 09's count at torch's dispatcher (:class:`~course_utils.tensor_parallel.CollectiveBytes`),
    extended to torch.distributed's eager collectives, the ones DeepSpeed calls. They reach the dispatcher
    as ``c10d::allreduce_`` (a list of tensors), ``c10d::_allgather_base_`` and ``c10d::_reduce_scatter_base_``
    (output first, input second), ...: each is counted under the name DeepSpeed's comms logger gives it,
    with the bytes of its input, as the logger records them, and those bytes by dtype.

    It sees what reaches the process group, whoever called it: a collective DeepSpeed issued around its
    logger (``deepspeed.comm``) would show here and not there.
    """

    def __init__(self) -> None:
        super().__init__()
        self.dtypes: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = getattr(getattr(func, "_overloadpacket", None), "_qualified_op_name", "")
        namespace, _, op = name.partition("::")
        if namespace != "c10d" or op not in _EAGER:
            return super().__torch_dispatch__(func, types, args, kwargs)  # torch's functional collectives, the rest
        out = func(*args, **(kwargs or {}))
        logged, position = _EAGER[op]
        self.calls[logged] += 1
        for t in _tensors_in(args[position]):
            self.bytes[logged] += t.numel() * t.element_size()
            self.dtypes[logged][str(t.dtype).removeprefix("torch.")] += t.numel() * t.element_size()
        return out


# torch.distributed's eager collectives as the dispatcher names them -> (the name DeepSpeed's logger gives the
# deepspeed.comm call that issues it, which argument is the input the logger measures)
_EAGER = {"allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0), "reduce_": ("reduce", 0),
          "broadcast_": ("broadcast", 0), "allgather_": ("all_gather", 1),
          "_allgather_base_": ("all_gather_into_tensor", 1),
          "allgather_into_tensor_coalesced_": ("all_gather_into_tensor", 1),
          "reduce_scatter_": ("reduce_scatter", 1), "_reduce_scatter_base_": ("reduce_scatter_tensor", 1),
          "reduce_scatter_tensor_coalesced_": ("reduce_scatter_tensor", 1)}


def per_step(calls: Mapping[str, float], input_bytes: Mapping[str, float], steps: int, ranks: int,
             dtypes: Mapping[str, Mapping[str, float]] | None = None) -> dict[str, dict[str, Any]]:
    """Each collective's calls and the bytes this rank sent in it (:func:`sent_per_rank`) per optimizer step,
    from the calls and the input bytes counted over ``steps`` steps (a barrier carries no data: left out);
    with ``dtypes`` (the input bytes of each collective by dtype), the bytes sent in each dtype too."""
    def sent(op: str, nbytes: float) -> float:
        return sent_per_rank(op, nbytes, ranks) / steps

    return {op: {"calls": round(calls[op] / steps, 2), "sent": sent(op, input_bytes[op]),
                 **({"by_dtype": {d: sent(op, b) for d, b in sorted(dtypes[op].items())}} if dtypes else {})}
            for op in sorted(calls) if op != "barrier"}


def start_counting_collectives() -> C10dCollectives:
    """Count the collectives of the steps from here, twice: DeepSpeed's comms logger forgets those of set-up
    (broadcasting and partitioning the model), and a :class:`C10dCollectives` is entered (returned, for
    :func:`stop_counting_collectives`)."""
    from deepspeed.comm import comms_logger

    comms_logger.comms_dict.clear()
    counter = C10dCollectives()
    counter.__enter__()
    return counter


def stop_counting_collectives(counter: C10dCollectives, steps: int, ranks: int) -> dict[str, dict[str, Any]]:
    """Both counts over the ``steps`` optimizer steps since :func:`start_counting_collectives` (:func:`per_step`),
    by the comms logger and at the dispatcher; then both off. The logger synchronises after every collective
    and the dispatcher's count runs Python for every op: the timed steps run without either."""
    import deepspeed.comm
    from deepspeed.comm import comms_logger

    counter.__exit__(None, None, None)
    deepspeed.comm.configure(enabled=False)
    # the logger's record: {name: {message size: [calls, latencies, ...]}}. The size is that of the call's input
    # (deepspeed/comm/comm.py:124, comm/utils.py:64-86: the argument named `tensor`, or `input_list`), which
    # for reduce_scatter_tensor(output_tensor, tensor) is the whole buffer (comm.py:317-331), and for
    # all_gather_into_tensor(output_tensor, tensor) this rank's shard (comm.py:334-343)
    logged = comms_logger.comms_dict
    logger = per_step({op: sum(v[0] for v in sizes.values()) for op, sizes in logged.items()},
                      {op: sum(size * v[0] for size, v in sizes.items()) for op, sizes in logged.items()}, steps, ranks)
    return {"logger": logger, "dispatcher": per_step(counter.calls, counter.bytes, steps, ranks, counter.dtypes)}


# --------------------------------------------------------------------------- #
# FSDP2
# --------------------------------------------------------------------------- #
def _local(t: Any) -> Any:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_param_groups(module: torch.nn.Module) -> list[Any]:
    """The FSDP2 parameter groups ``fully_shard`` gave this module: a list in torch 2.14, one group
    (``_fsdp_param_group``, or None) in torch 2.11, the GPU machines' (read there on an H200)."""
    state = module._get_fsdp_state() if hasattr(module, "_get_fsdp_state") else None
    if state is None:
        return []
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]


def fsdp_gradient_bytes(model: torch.nn.Module) -> int:
    """Bytes of gradients this rank holds after a backward pass: its sharded ``.grad``, and, while
    gradient sync is off (``set_requires_gradient_sync(False)`` between micro-batches), the whole
    unsharded gradients FSDP2 accumulates instead (upcast to the reduce dtype), which ``.grad`` does not
    show. (Read from FSDP2's parameter groups: the allocator sees them only on a GPU.)"""
    held = [_local(p.grad) for p in model.parameters()]
    groups = [group for module in model.modules() for group in _fsdp_param_groups(module)]
    if not groups:
        raise RuntimeError(f"torch {torch.__version__}: no FSDP2 parameter group found on the model (is it under "
                           "fully_shard?); the unsharded gradients it accumulates would go uncounted")
    for group in groups:
        for fsdp_param in group.fsdp_params:
            unsharded = getattr(fsdp_param, "_unsharded_param", None)
            held += [getattr(fsdp_param, "unsharded_accumulated_grad", None),
                     unsharded.grad if isinstance(unsharded, torch.Tensor) else None]
    return _nbytes(t for t in held if t is not None)


def fsdp_memory(model: torch.nn.Module, optimizer: torch.optim.Optimizer, gradient_bytes: int) -> dict[str, Any]:
    """Bytes of params (this rank's shards: FSDP2 keeps them in fp32, so they are also the master
    copy), gradients and optimizer moments this rank holds under ``fully_shard``."""
    state = [_local(t) for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    return {"params": _nbytes(_local(p) for p in model.parameters()), "gradients": gradient_bytes,
            "optimizer": _nbytes(state), "optimizer_device": ",".join(sorted({t.device.type for t in state}))}


def warm_deepspeed_ops() -> None:
    """Build the C++ ops DeepSpeed compiles on first use on this machine, once per environment
    (``make setup`` runs this, so that no notebook or test pays the build, and no two ranks race for it).
    That is the CPU accelerator's shared-memory collectives, on a GPU node too: notebook 07 runs its ranks on the
    CPU wherever a node has fewer GPUs than ranks (a 1-GPU portal, one H100), and the CUDA accelerator has no such op.
    """
    os.environ.update(deepspeed_env(use_gpu=False))  # (make setup's own process)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)
        print(f"DeepSpeed's {builder.NAME} op is built in {os.environ['TORCH_EXTENSIONS_DIR']}")
