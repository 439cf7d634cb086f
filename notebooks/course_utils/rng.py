"""Every random stream a training step draws from, saved and restored with a checkpoint."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch


def rng_state() -> dict[str, Any]:
    """Every random stream a training step draws from (augmentation in the main
    process, dropout), so a resumed run continues exactly where it stopped.

    Every rank seeds the same way and draws the same number of values per
    step, so rank 0's state, saved in the checkpoint, is every rank's state.
    """
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate(),
                             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        # this rank's GPU only: a resumed job may see a different number of GPUs per process
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"].cpu())
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


def rng_state_json() -> dict[str, Any]:
    """:func:`rng_state` as plain lists and numbers, for a checkpoint whose progress is JSON
    (``checkpoint.save_sharded``)."""
    state = rng_state()
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    out = {"torch": state["torch"].tolist(), "python": [version, list(internal), gauss],
           "numpy": [name, keys.tolist(), pos, has_gauss, cached]}
    if "cuda" in state:
        out["cuda"] = state["cuda"].tolist()
    return out


def set_rng_state_json(state: dict[str, Any]) -> None:
    """Restore what :func:`rng_state_json` saved."""
    version, internal, gauss = state["python"]
    name, keys, pos, has_gauss, cached = state["numpy"]
    restored = {"torch": torch.tensor(state["torch"], dtype=torch.uint8), "python": (version, tuple(internal), gauss),
                "numpy": (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)}
    if "cuda" in state:
        restored["cuda"] = torch.tensor(state["cuda"], dtype=torch.uint8)
    set_rng_state(restored)
