"""Checkpoints that survive a job dying mid-write.

``save_checkpoint`` writes to a temporary file in the same folder, flushes it
to disk, then ``os.replace``-s it over the old one. A rename within one file
system is atomic, so a reader sees either the old checkpoint or the new one,
never half of either; a job killed mid-write leaves the last good checkpoint
readable (and at worst a stray ``.tmp`` file). The checkpoint it replaces is
kept beside it (``last.prev.pt`` for ``last.pt``): a file damaged later (a
full quota, a copy cut short) costs one checkpoint interval, not the run.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable
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


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be resumed from; the message names the file and what to do."""


def previous_path(path: str | Path) -> Path:
    """Where the checkpoint before ``path`` is kept: ``last.pt`` -> ``last.prev.pt``."""
    path = Path(path)
    return path.with_name(f"{path.stem}.prev{path.suffix}")


def save_checkpoint(state: dict[str, Any], path: str | Path) -> Path:
    """Atomically write ``state`` (anything ``torch.save`` takes) to ``path``; the old one becomes
    :func:`previous_path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            torch.save(state, fh)
            fh.flush()
            os.fsync(fh.fileno())
        if path.exists():
            _keep_previous(path)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    try:  # make the renames themselves durable
        dir_fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass  # some file systems do not fsync directories; the rename still happened
    return path


def _keep_previous(path: Path) -> None:
    """Make the current checkpoint the previous one, with no moment where neither exists."""
    prev = previous_path(path)
    link = prev.with_name(f".{prev.name}.link")
    link.unlink(missing_ok=True)
    try:
        os.link(path, link)  # a second name for the same file, then swapped in atomically
        os.replace(link, prev)
    except OSError:  # a file system without hard links: a rename leaves the old one as prev only
        os.replace(path, prev)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint onto ``map_location`` (a GPU checkpoint opens on a
    CPU-only laptop, and rank N does not load rank 0's tensors onto GPU 0).

    A truncated or corrupt file raises :class:`CheckpointError` naming it, not
    an unpickling traceback.
    """
    path = Path(path)
    try:
        return torch.load(path, map_location=map_location, weights_only=False)
    except (pickle.UnpicklingError, zipfile.BadZipFile, EOFError, RuntimeError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        prev = previous_path(path)
        fix = f"delete it to resume from {prev.name}" if prev.exists() else "delete it to start afresh"
        raise CheckpointError(f"the checkpoint {path} is unreadable (truncated or corrupt: {first}); {fix}, "
                              "or give a new folder") from exc


def load_latest(path: str | Path, map_location: str | torch.device = "cpu",
                say: Callable[[str], None] = print) -> tuple[Path, dict[str, Any]] | None:
    """The newest readable checkpoint: ``path``, else the one before it; None when there is none.

    An unreadable ``path`` with a readable previous checkpoint is said (``say``)
    and passed over; with none to fall back to it raises :class:`CheckpointError`.
    """
    path = Path(path)
    prev = previous_path(path)
    if not path.exists():
        return (prev, load_checkpoint(prev, map_location)) if prev.exists() else None
    try:
        return path, load_checkpoint(path, map_location)
    except CheckpointError as exc:
        if not prev.exists():
            raise
        say(f"{exc}\nresuming from the checkpoint before it, {prev}")
        return prev, load_checkpoint(prev, map_location)
