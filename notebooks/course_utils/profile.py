"""The one knob that sizes every notebook: ``COURSE_PROFILE=ci|full``.

``ci`` is small enough for a 2-core CPU machine under CI; ``full`` is what a
GPU node should run. Unset, the profile is ``full`` when a GPU is visible and
``ci`` otherwise, so a laptop and a cluster both do the sensible thing.
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
        return "full" if torch.cuda.is_available() else "ci"
    if value not in PROFILES:
        raise ValueError(
            f"{ENV_VAR}={os.environ[ENV_VAR]!r} is not a valid profile; "
            f"choose one of: {', '.join(PROFILES)} (or unset it for the default)."
        )
    return value


def pick(ci: T, full: T) -> T:
    """Choose a size by profile: ``EPOCHS = pick(ci=1, full=30)``."""
    return ci if current_profile() == "ci" else full
