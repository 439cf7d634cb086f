"""The process group's life: join it (or not, with one process), ask about it, leave it."""

from __future__ import annotations

import atexit
import contextlib
import datetime as _dt
import gc
import os
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist

from ..devices import local_view, place_ranks
from .env import DistEnv, detect_env
from .rendezvous import rendezvous

DEFAULT_TIMEOUT_S = 600
"""Seconds a collective may wait for a peer (``$COURSE_DIST_TIMEOUT``): long
enough for rank 0 to write a large checkpoint while the others wait."""

DEFAULT_JOIN_TIMEOUT_S = 45
"""Seconds every rank may take to arrive at the start (``$COURSE_JOIN_TIMEOUT``)."""


def choose_device(requested: str = "auto") -> torch.device:
    """The device of a single process: ``auto`` is its first GPU if it sees one, else the CPU.

    ``cuda`` without a GPU is an error that says so, rather than a crash deep
    inside the first kernel launch. Several ranks are placed together by
    :func:`course_utils.devices.place_ranks` during the rendezvous.
    """
    return torch.device(place_ranks([local_view()], requested)[0].device)


def init_distributed(
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float | None = None,
    join_timeout_s: float | None = None,
    group_of_one: bool = False,
) -> tuple[DistEnv, torch.device]:
    """Join the process group if a launcher started several processes.

    Returns this process's :class:`DistEnv` and the device it should use. With
    world size 1 no process group is created. Every rank must arrive within
    ``join_timeout_s`` (default ``$COURSE_JOIN_TIMEOUT`` or 45 s), else the
    error names the missing ranks and the address; each collective may then
    wait ``timeout_s`` (default ``$COURSE_DIST_TIMEOUT`` or 600 s).

    ``device`` (``auto``, ``cpu``, ``cuda``, ``cuda:N``) is placed by
    :func:`course_utils.devices.place_ranks`: one GPU per rank with NCCL, never
    two ranks on one GPU; with ``auto``, a host with more ranks than GPUs runs
    every rank on the CPU with gloo and rank 0 says why in one line.

    ``group_of_one``: started without a launcher, still form a group (of one
    process), for libraries that need one (FSDP2's device mesh, DeepSpeed).
    """
    info = detect_env()
    if dist.is_initialized():  # formed elsewhere (a framework, an earlier call): its ranks' devices are set
        return info, _group_device()
    if not info.is_distributed:
        dev = choose_device(device)
        if group_of_one:
            if dev.type == "cuda":
                torch.cuda.set_device(dev)
            atexit.register(_release_at_exit)
            dist.init_process_group(backend="nccl" if dev.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                    world_size=1, device_id=dev if dev.type == "cuda" else None)
        return info, dev

    if timeout_s is None:
        timeout_s = collective_timeout_s()
    if join_timeout_s is None:
        join_timeout_s = float(os.environ.get("COURSE_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S))
    # Slurm and MPI do not set these; the rendezvous needs them.
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    store, placement = rendezvous(info, join_timeout_s, device)
    dev = torch.device(placement.device)
    if placement.note and info.rank == 0:
        print(f"note: {placement.note}", file=sys.stderr, flush=True)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    atexit.register(_release_at_exit)
    # the group every rank joins: how long its collectives wait for a peer, and (NCCL) the rank's own GPU
    dist.init_process_group(
        backend=backend or placement.backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
        # NCCL then knows each rank's GPU for barrier() and object collectives, instead of guessing, and creates
        # its communicator here rather than inside the first collective, where no timeout applies
        device_id=dev if dev.type == "cuda" else None,
    )
    return info, dev


def group_device(backend_config: str, gpu: int | None) -> torch.device:
    """This rank's device in a process group that already exists: ``cuda:<gpu>`` where the group reaches GPUs
    through NCCL and this rank has a GPU, else the CPU.

    ``backend_config``: ``dist.get_backend_config()``, ``"nccl"``, ``"gloo"``, or ``"cpu:gloo,cuda:nccl"`` for
    a group formed without naming a backend (``dist.get_backend()`` then says ``"undefined"``). ``gpu``: the
    index of the GPU this rank drives (the group's bound ``device_id``, else the current device); None without
    one.
    """
    nccl = any(part.rsplit(":", 1)[-1].strip() == "nccl" for part in backend_config.lower().split(","))
    return torch.device("cuda", gpu) if nccl and gpu is not None else torch.device("cpu")


def _group_device() -> torch.device:
    """:func:`group_device` for the default group, with this rank's facts."""
    config = dist.get_backend_config()
    gpu = None
    if "nccl" in config.lower():  # only then is there a GPU to ask about (a rank, not a kernel that forks)
        bound = dist.distributed_c10d._get_default_group().bound_device_id  # init_process_group(device_id=...)
        if bound is not None and bound.type == "cuda":
            gpu = bound.index
        elif torch.cuda.is_available():
            gpu = torch.cuda.current_device()  # the framework that formed the group set it (Lightning, Ray Train)
    return group_device(config, gpu)


@contextlib.contextmanager
def session(device: str = "auto", **kwargs: float | str | None) -> Iterator[tuple[DistEnv, torch.device]]:
    """``with session(args.device) as (info, device):`` join the group, and leave it however the block ends.

    Replaces the ``init_distributed() ... try: ... finally: cleanup()`` every
    script would otherwise end with. Errors while joining propagate unchanged.
    """
    info, dev = init_distributed(device, **kwargs)  # type: ignore[arg-type]
    try:
        yield info, dev
    except BaseException:
        cleanup(meet_first=False)  # the other ranks may never reach a barrier now
        raise
    cleanup()


def _release_at_exit() -> None:
    """Free process groups while the interpreter is still alive.

    DDP modules keep a reference to their process group inside reference
    cycles; left to interpreter finalization, gloo's worker threads are torn
    down without the GIL and the process can abort ("terminate called without
    an active exception") after all its work is done. Collecting here, before
    finalization, releases them cleanly.
    """
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


def collective_timeout_s() -> float:
    """Seconds a collective may wait for a peer: ``$COURSE_DIST_TIMEOUT``, or :data:`DEFAULT_TIMEOUT_S`."""
    return float(os.environ.get("COURSE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))


def cleanup(meet_first: bool | None = None) -> None:
    """Leave the process group (if any) so the process exits without warnings.

    All ranks meet at a barrier first, so none tears down its connections while
    a peer is still using them. After an error on one rank, the others would
    wait there: ``meet_first=False`` skips it, and so does the default inside a
    ``finally`` that an exception is passing through.
    """
    if meet_first is None:
        meet_first = sys.exc_info()[0] is None
    if dist.is_available() and dist.is_initialized():
        if meet_first:
            with contextlib.suppress(Exception):
                dist.barrier()
        dist.destroy_process_group()


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    return get_rank() == 0


def barrier() -> None:
    if is_initialized():
        dist.barrier()


def parallel_mesh(device: torch.device, tp: int = 1):
    """Every rank on one ``DeviceMesh`` of named dimensions, ``("dp", "tp")``: ``tp`` ranks split each layer
    (tensor parallel), and the ``world // tp`` groups of them are data parallel (replicas, or the ranks FSDP2
    shards across: ``mesh["dp"]``). Node-major, as torchtitan's ``ParallelDims`` builds it: ranks
    ``d * tp .. d * tp + tp - 1``, one node's GPUs under Slurm's and torchrun's numbering, form group ``d``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = get_world_size()
    if tp < 1 or world % tp:
        raise ValueError(f"a tensor-parallel degree of {tp} does not divide the {world} ranks: choose one that does "
                         "(the GPUs of a node, as slurm/*/multi_node_2d.sbatch does)")
    return init_device_mesh(device.type, (world // tp, tp), mesh_dim_names=("dp", "tp"))
