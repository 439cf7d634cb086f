"""The one knob that sizes every notebook: ``COURSE_PROFILE=ci|full``.

``ci`` is small enough for a 2-core CPU machine under CI; ``full`` is what a
GPU node should run. Unset, the profile is ``full`` when a GPU is visible and
``ci`` otherwise, so a laptop and a cluster both do the sensible thing.

Notebook kernels call this before they fork ranks, so it must not start CUDA:
it counts GPUs with :func:`gpus_visible` (NVML, the driver's management library),
not ``torch.cuda.is_available()``, which initialises the CUDA driver (a forked
child then cannot use the GPU).
"""

from __future__ import annotations

import itertools
import os
from typing import TypeVar

import torch

PROFILES = ("ci", "full")
ENV_VAR = "COURSE_PROFILE"

T = TypeVar("T")


def gpus_visible() -> int:
    """How many GPUs this process may use, counted without the CUDA runtime (safe before a fork).

    ``torch.cuda.device_count()`` asks NVML; where NVML cannot answer, it asks the CUDA runtime
    (``cudaGetDeviceCount`` initialises the driver, and torch marks every later fork unusable for
    CUDA). NVML cannot place MIG slices (``CUDA_VISIBLE_DEVICES=MIG-...``, a portal's slice of an
    A100), so those are counted from the variable: each named slice is a GPU to this process.
    Without NVML at all (no NVIDIA driver, as on this CI machine) torch still asks the runtime,
    which finds no GPU a forked child could lose (a container given libcuda but not NVML would).
    """
    named = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")
    slices = list(itertools.takewhile(lambda d: d.strip().startswith("MIG-"), named))  # CUDA stops at the first other
    if slices:
        return len(slices)
    return torch.cuda.device_count()


def current_profile() -> str:
    """Return ``"ci"`` or ``"full"``; raise ``ValueError`` on anything else."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return "full" if gpus_visible() > 0 else "ci"
    if value not in PROFILES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a valid profile; "
            f"choose one of: {', '.join(PROFILES)} (or unset it for the default)."
        )
    return value


def pick(ci: T, full: T, device: str | None = None) -> T:
    """Choose a size by profile: ``EPOCHS = pick(ci=1, full=30)``.

    ``device``: where the demo will run. A demo that the device policy moved
    to the CPU in a GPU session (a 1-GPU portal asked for 4 ranks) gets the
    CPU sizes, so it finishes in minutes rather than hours.
    """
    if current_profile() == "ci":
        return ci
    if device is not None and str(device).startswith("cpu") and gpus_visible() > 0:
        return ci
    return full
