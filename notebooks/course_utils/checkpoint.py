"""Checkpoints that survive a job dying mid-write.

``save_checkpoint`` writes to a temporary file in the same folder, flushes it
to disk, then ``os.replace``-s it over the old one. A rename within one file
system is atomic, so a reader sees either the old checkpoint or the new one,
never half of either; a job killed mid-write leaves the last good checkpoint
readable (and at worst a stray ``.tmp`` file). The checkpoint it replaces is
kept beside it (``last.prev.pt`` for ``last.pt``): a file damaged later (a
full quota, a copy cut short) costs one checkpoint interval, not the run.

Sharded checkpoints (``save_sharded``, ``load_sharded``: ``torch.distributed.checkpoint``) are for models
no rank holds whole (FSDP2, tensor and pipeline parallel): every rank writes its own shards into a new
folder, then a pointer file is replaced atomically; they resume on any number of ranks.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import zipfile
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from .errors import first_line


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
        first = first_line(exc)
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


# --------------------------------------------------------------------------- #
# Sharded checkpoints: torch.distributed.checkpoint (DCP)
# --------------------------------------------------------------------------- #
def flat_state_dict_options() -> Any:
    """The optimizer's state and settings keyed by parameter name ("param_groups.blocks.1.0.weight.lr"), not
    as one list of groups: pipeline stages hold different parameters, and DCP keeps one rank's copy of
    an item every rank saves under the same key (torchtitan saves the same way)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def save_sharded(folder: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 progress: dict[str, Any]) -> Path:
    """A sharded checkpoint with ``torch.distributed.checkpoint``: every rank writes its own shards of the
    model and the optimizer (no rank gathers the whole) into a new folder, ``folder/step-N``; then rank 0
    points ``folder/latest`` at it and removes the one before. A job killed mid-write leaves the previous
    checkpoint whole. ``progress`` (epoch, step, losses, the configuration) is kept beside, as JSON."""
    import json
    import shutil

    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    folder = Path(folder)
    shared = [progress]
    dist.broadcast_object_list(shared, src=0)  # one progress for all: DCP keeps one rank's copy of such items
    progress = shared[0]
    model_state, optim_state = get_state_dict(model, optimizer, options=flat_state_dict_options())
    target = folder / f"step-{progress['step']}"
    dcp.save({"model": model_state, "optim": optim_state, "progress": json.dumps(progress)}, checkpoint_id=target)
    dist.barrier()  # every shard written
    if dist.get_rank() == 0:
        previous = latest_sharded(folder)
        (folder / "latest.tmp").write_text(target.name)
        os.replace(folder / "latest.tmp", folder / "latest")  # atomic: the old checkpoint or the new one
        if previous is not None and previous != target:
            shutil.rmtree(previous, ignore_errors=True)
    dist.barrier()
    return target


def weights_digest(tensors: Iterable[torch.Tensor]) -> str:
    """A fingerprint of whole weights (in their order, as fp32 bytes): a resumed run reports the one of the
    weights it loaded, the run that saved them the one of the weights it ended with; equal only if the resume
    really loaded them (a restart from scratch has the same step count and, on a CPU, the same losses)."""
    import hashlib

    digest = hashlib.sha256()
    for t in tensors:
        digest.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def latest_sharded(folder: str | Path | None) -> Path | None:
    """The checkpoint ``folder/latest`` names, if there is one."""
    pointer = Path(folder) / "latest" if folder else None
    return pointer.parent / pointer.read_text().strip() if pointer is not None and pointer.is_file() else None


def load_sharded(path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Load a :func:`save_sharded` checkpoint into a model already sharded (``fully_shard``) on any number of
    ranks: each rank reads the pieces of the saved shards that make up its own, so a checkpoint written by
    4 ranks resumes on 2 or on 1. Returns the saved ``progress``."""
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from torch.distributed.checkpoint.api import CheckpointException

    model_state, optim_state = get_state_dict(model, optimizer, options=flat_state_dict_options())
    state = {"model": model_state, "optim": optim_state, "progress": ""}
    try:
        # its metadata first, here: every rank reads the same file and fails alike, before dcp.load, which
        # would print each rank's traceback of it
        dcp.FileSystemReader(Path(path)).read_metadata()
        dcp.load(state, checkpoint_id=Path(path))  # in place, into this rank's shards
        progress = json.loads(state["progress"])
    except (CheckpointException, pickle.UnpicklingError, EOFError, OSError, ValueError) as exc:
        # DCP gathers every rank's failure into one exception on all ranks: each rank stops here, none waits
        raise CheckpointError(
            f"the sharded checkpoint {path} cannot be read ({type(exc).__name__}): it was not written whole or "
            f"was damaged. Remove {Path(path).parent / 'latest'} to resume from nothing, or give another "
            "checkpoint folder") from None
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=flat_state_dict_options())
    return progress


def consolidate_sharded(path: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """One plain file from a sharded checkpoint (``dcp_to_torch_save``, in one process, no group needed):
    the whole model's ``state_dict``, which any PyTorch code loads without FSDP."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(Path(path), Path(out))
    return torch.load(out, map_location="cpu", weights_only=False)["model"]
