"""What a rank holds and sends, measured: the tensors DeepSpeed's engine and FSDP2 keep, and the collectives
counted at torch's dispatcher."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..tensor_parallel import CollectiveBytes
from .theory import sent_per_rank


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


def local_bytes(tensors: Iterable[Any]) -> int:
    """Bytes this rank holds of ``tensors``: each DTensor's local part (FSDP2's shard, tensor parallel's
    slice), plain tensors whole, each buffer once."""
    return _nbytes(_local(t) for t in tensors if t is not None)


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
    return {"params": local_bytes(model.parameters()), "gradients": gradient_bytes,
            "optimizer": _nbytes(state), "optimizer_device": ",".join(sorted({t.device.type for t in state}))}
