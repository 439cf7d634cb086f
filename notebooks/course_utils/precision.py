"""Number formats a training step may run in, and what this device can do.

``fp32`` everywhere (with TF32 tensor cores inside matmuls and convolutions
when switched on), or autocast to ``bf16`` or ``fp16`` (with a GradScaler);
``amp`` picks the better of the two for the device.
"""

from __future__ import annotations

import contextlib

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "amp")


def resolve_precision(precision: str, device: torch.device) -> str:
    """Turn ``amp`` into ``bf16`` or ``fp16`` for this device; reject what it cannot do."""
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if device.type == "cuda":
        bf16_ok = torch.cuda.is_bf16_supported()
        if precision == "amp":
            return "bf16" if bf16_ok else "fp16"
        if precision == "bf16" and not bf16_ok:
            raise ValueError(
                f"{torch.cuda.get_device_name(device)} has no bf16 support "
                "(pre-Ampere, e.g. Frontera's RTX 5000): use --precision fp16 or amp."
            )
        return precision
    if precision == "amp":
        return "bf16"  # CPU autocast supports bf16; fp16 on CPU is rarely faster
    if precision == "fp16":
        raise ValueError("fp16 with a GradScaler is a GPU technique; on CPU use bf16 or fp32.")
    return precision


def set_tf32(enabled: bool | None) -> None:
    """TF32 tensor-core math for fp32 matmuls and convolutions (Ampere and later).

    A process-wide switch: 10 mantissa bits instead of 23 inside the matmul,
    fp32 everywhere else. ``None`` restores PyTorch's defaults (convolutions
    may use TF32, matmuls do not), which is what a textbook loop runs with.
    It has no effect on CPUs or pre-Ampere GPUs.
    """
    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    torch.backends.cudnn.allow_tf32 = True if enabled is None else enabled


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's context for a resolved ``precision`` (see :func:`resolve_precision`)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)
