"""Activation checkpointing per transformer block, through torch's ``checkpoint_wrapper``.

``full``: a block keeps only its input; the backward pass runs its forward again. ``selective``: a block keeps
the outputs of its matmuls and of attention (the expensive ops) and recomputes the cheap ones between them
(norms, RoPE, SiLU, the products), which hold as many bytes but cost few FLOPs (Korthikanti et al., 2022;
torchtitan's op-level policy, simplified).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

AC_MODES = ("none", "selective", "full")


def _saved_ops() -> set:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten._scaled_dot_product_flash_attention.default,
           aten._scaled_dot_product_efficient_attention.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        op = getattr(aten, name, None)  # not in every build
        ops |= {op.default} if op is not None else set()
    return ops


def _policy(ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    return CheckpointPolicy.MUST_SAVE if op in _saved_ops() else CheckpointPolicy.PREFER_RECOMPUTE


def apply_ac(model: nn.Module, mode: str) -> None:
    """Wrap each of ``model.layers`` for ``mode`` (``none``, ``selective`` or ``full``)."""
    # a private module, as torchtitan uses it too; in a forward of your own, torch.utils.checkpoint.checkpoint(block, x,
    # use_reentrant=False) does the same for one call
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if mode not in AC_MODES:
        raise ValueError(f"--ac takes {', '.join(AC_MODES)}, not {mode!r}")
    if mode == "none":
        return
    for name, block in list(model.layers.items()):
        if mode == "full":
            model.layers[name] = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            model.layers[name] = checkpoint_wrapper(
                block, context_fn=partial(create_selective_checkpoint_contexts, _policy), preserve_rng_state=False)


class SavedForBackward:
    """The bytes autograd keeps for the backward pass while this context is open: every tensor a forward saves
    (``torch.autograd.graph.saved_tensors_hooks``), each storage once, parameters left out (the model's state,
    not its activations). What a rank's activations cost, on a CPU as on a GPU, whatever the layout."""

    def __init__(self) -> None:
        self.storages: dict[int, int] = {}

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, nn.Parameter) and t.device.type != "meta":
            local = getattr(t, "_local_tensor", t)  # a DTensor (tensor parallel): this rank's part of it
            try:
                storage = local.untyped_storage()
                self.storages[storage.data_ptr()] = storage.nbytes()
            except RuntimeError:  # another tensor subclass, without a storage of its own: its bytes
                self.storages[id(local)] = local.numel() * local.element_size()
        return t

    def __enter__(self) -> "SavedForBackward":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)

    @property
    def bytes(self) -> int:
        return sum(self.storages.values())


def measure_step(model: nn.Module, tokens: torch.Tensor, repeats: int = 3) -> tuple[float, float]:
    """One forward and backward pass of ``model`` on ``tokens``: the peak memory above the model's own state
    (MiB: CUDA's allocator on a GPU, torch's MemTracker on a CPU, which counts every tensor) and the median
    time of ``repeats`` passes (ms, the GPU synchronised)."""
    import time

    from ..timing import sync

    device = tokens.device

    def step() -> None:
        model(tokens).float().logsumexp(-1).mean().backward()
        model.zero_grad(set_to_none=True)

    step()  # warm: kernels chosen, allocator grown
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        peak = torch.cuda.max_memory_allocated(device) - before
    else:
        from torch.distributed._tools.mem_tracker import MemTracker

        tracker = MemTracker()
        tracker.track_external(model)
        with tracker:
            step()
        snapshot = tracker.get_tracker_snapshot("peak")[device]
        peak = snapshot["Total"] - snapshot[next(k for k in snapshot if str(k).endswith("PARAM"))]
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - start)
    return peak / 2**20, 1000 * sorted(times)[len(times) // 2]
