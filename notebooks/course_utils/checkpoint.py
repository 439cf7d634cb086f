"""Checkpoints that survive a job dying mid-write.

``save_checkpoint`` writes to a temporary file in the same folder, flushes it
to disk, then ``os.replace``-s it over the old one. A rename within one file
system is atomic, so a reader sees either the old checkpoint or the new one,
never half of either; a job killed mid-write leaves the last good checkpoint
readable (and at worst a stray ``.tmp`` file).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def ensure_writable_dir(path: str | Path, what: str = "folder") -> Path:
    """Create ``path`` and prove it is writable now, before hours of training
    produce a checkpoint that cannot be saved."""
    path = Path(path).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-test-"):
            pass
    except OSError as exc:
        raise PermissionError(
            f"the {what} {path} is not writable ({exc.strerror}). Choose another folder "
            f"(on FT3 $STORE or $LUSTRE, on Frontera $WORK or $SCRATCH) or fix its permissions."
        ) from exc
    return path


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Atomically write ``state`` (anything ``torch.save`` takes) to ``path``."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass  # some file systems do not fsync directories; the rename still happened
    return path


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint onto ``map_location`` (a GPU checkpoint opens on a
    CPU-only laptop, and rank N does not load rank 0's tensors onto GPU 0)."""
    return torch.load(Path(path), map_location=map_location, weights_only=False)
