"""The one knob that sizes every notebook: ``COURSE_PROFILE=ci|full``.

``ci`` is small enough for a 2-core CPU machine under CI; ``full`` is what a
GPU node should run. Unset, the profile is ``full`` when a GPU is visible and
``ci`` otherwise, so a laptop and a cluster both do the sensible thing.

Notebook kernels call this before they fork ranks, so it must not start CUDA:
it counts GPUs with ``torch.cuda.device_count()``, which asks NVML, not
``torch.cuda.is_available()``, which initialises the CUDA driver (a forked
child then cannot use the GPU).
"""

from __future__ import annotations

import os
from typing import TypeVar

import torch

PROFILES = ("ci", "full")
ENV_VAR = "COURSE_PROFILE"

T = TypeVar("T")


def current_profile() -> str:
    """Return ``"ci"`` or ``"full"``; raise ``ValueError`` on anything else."""
    value = os.environ.get(ENV_VAR, "").strip().lower()
    if not value:
        return "full" if torch.cuda.device_count() > 0 else "ci"
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
    if device is not None and str(device).startswith("cpu") and torch.cuda.device_count() > 0:
        return ci
    return full
