"""Launcher-agnostic process-group setup.

One process per device, whoever started it: ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), Slurm's ``srun`` (``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the node list) or OpenMPI's
``mpirun`` (``OMPI_COMM_WORLD_*``). A plain ``python script.py`` is world
size 1 and creates no process group at all, so the same script runs on a
laptop and under every launcher without a code path chosen by hand.

As in NERSC's ``utils/comm.py``, :func:`get_rank` and :func:`get_world_size`
answer 0 and 1 when no process group exists.
"""

from __future__ import annotations

import datetime as _dt
import itertools
import os
import re
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 120
"""Seconds a collective (and the initial rendezvous) may wait for a peer."""


@dataclass(frozen=True)
class DistEnv:
    """Who this process is, as its launcher told it through the environment."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    launcher: str = "none"  # torchrun | slurm | mpi | none

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1


# --------------------------------------------------------------------------- #
# Slurm host lists
# --------------------------------------------------------------------------- #
def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: ``a[1,2],b`` -> 2 parts."""
    parts, depth, current = [], 0, []
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    parts.append("".join(current))
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range_list(body: str) -> list[str]:
    """``01-03,7`` -> ``["01", "02", "03", "7"]`` keeping zero padding."""
    out: list[str] = []
    for item in body.split(","):
        item = item.strip()
        if "-" in item:
            lo, hi = item.split("-", 1)
            width = len(lo) if lo.startswith("0") else 0
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ValueError(f"bad range {item!r} in Slurm host list")
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        elif item:
            out.append(item)
    return out


def expand_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm host list into host names, in order.

    >>> expand_hostlist("n[1-3,5]")
    ['n1', 'n2', 'n3', 'n5']
    >>> expand_hostlist("gpu-a[01-02],login1")
    ['gpu-a01', 'gpu-a02', 'login1']
    >>> expand_hostlist("r[1-2]n[01-02]")
    ['r1n01', 'r1n02', 'r2n01', 'r2n02']
    """
    hosts: list[str] = []
    for token in _split_top_level(hostlist):
        if token.count("[") != token.count("]"):
            raise ValueError(f"unbalanced brackets in Slurm host list {hostlist!r}")
        pieces = re.split(r"(\[[^\]]*\])", token)
        choices = [
            _expand_range_list(p[1:-1]) if p.startswith("[") else [p] for p in pieces if p
        ]
        hosts.extend("".join(combo) for combo in itertools.product(*choices))
    return hosts


def port_from_job_id(job_id: int | str, base: int = 20000, span: int = 20000) -> int:
    """A rendezvous port derived from the Slurm job id, so that two jobs
    sharing a node never pick the same one (unlike a hard-coded 29500)."""
    return base + int(job_id) % span


# --------------------------------------------------------------------------- #
# Reading the launcher's environment
# --------------------------------------------------------------------------- #
def _int(env: Mapping[str, str], key: str, default: int) -> int:
    value = env.get(key)
    if value is None or value == "":
        return default
    try:
        return int(value)
    except ValueError as exc:
        raise ValueError(f"environment variable {key}={value!r} is not an integer") from exc


def detect_env(env: Mapping[str, str] | None = None) -> DistEnv:
    """Read rank and world size from whichever launcher started this process.

    Order matters: ``srun torchrun`` sets both Slurm and torchrun variables and
    torchrun's are the per-process truth; ``mpirun`` inside an sbatch job sees
    the batch step's Slurm variables, so OpenMPI's win over Slurm's.
    """
    env = os.environ if env is None else env
    addr = env.get("MASTER_ADDR", "127.0.0.1")
    port = _int(env, "MASTER_PORT", 29500)

    if "RANK" in env and "WORLD_SIZE" in env:
        return DistEnv(
            rank=_int(env, "RANK", 0),
            local_rank=_int(env, "LOCAL_RANK", 0),
            world_size=_int(env, "WORLD_SIZE", 1),
            local_world_size=_int(env, "LOCAL_WORLD_SIZE", 1),
            master_addr=addr,
            master_port=port,
            launcher="torchrun",
        )

    if "OMPI_COMM_WORLD_RANK" in env:
        return DistEnv(
            rank=_int(env, "OMPI_COMM_WORLD_RANK", 0),
            local_rank=_int(env, "OMPI_COMM_WORLD_LOCAL_RANK", 0),
            world_size=_int(env, "OMPI_COMM_WORLD_SIZE", 1),
            local_world_size=_int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 1),
            master_addr=addr,
            master_port=port,
            launcher="mpi",
        )

    # SLURM_STEP_NUM_TASKS is set by srun only. A plain `python train.py` in
    # the batch script (or in salloc) is one process, whatever --ntasks says.
    if "SLURM_PROCID" in env and "SLURM_STEP_NUM_TASKS" in env:
        nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
        if "MASTER_ADDR" not in env and nodelist:
            addr = expand_hostlist(nodelist)[0]
        if "MASTER_PORT" not in env and env.get("SLURM_JOB_ID"):
            port = port_from_job_id(env["SLURM_JOB_ID"])
        world = _int(env, "SLURM_STEP_NUM_TASKS", 1)
        nodes = max(1, _int(env, "SLURM_STEP_NUM_NODES", _int(env, "SLURM_NNODES", 1)))
        return DistEnv(
            rank=_int(env, "SLURM_PROCID", 0),
            local_rank=_int(env, "SLURM_LOCALID", 0),
            world_size=world,
            local_world_size=max(1, world // nodes),
            master_addr=addr,
            master_port=port,
            launcher="slurm",
        )

    return DistEnv(master_addr=addr, master_port=port)


# --------------------------------------------------------------------------- #
# Backend and device
# --------------------------------------------------------------------------- #
def choose_backend(device_type: str | None = None) -> str:
    """NCCL when this process drives a CUDA device and NCCL is built in, else gloo."""
    if device_type is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
    if device_type == "cuda" and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def choose_device(requested: str = "auto", local_rank: int = 0) -> torch.device:
    """``auto``: this rank's GPU if there is one, else the CPU.

    ``cuda`` without a GPU is an error that says so, rather than a crash deep
    inside the first kernel launch.
    """
    requested = requested.lower()
    if requested == "auto":
        requested = "cuda" if torch.cuda.is_available() else "cpu"
    if requested.startswith("cuda"):
        if not torch.cuda.is_available():
            raise RuntimeError(
                "--device cuda was asked for but no CUDA GPU is visible to this process "
                "(torch.cuda.is_available() is False). Run on a GPU node, or use --device cpu."
            )
        if requested == "cuda":
            return torch.device("cuda", local_rank % torch.cuda.device_count())
        return torch.device(requested)
    if requested == "cpu":
        return torch.device("cpu")
    raise ValueError(f"unknown device {requested!r}: use auto, cpu, cuda or cuda:N")


# --------------------------------------------------------------------------- #
# Process group lifecycle
# --------------------------------------------------------------------------- #
def init_distributed(
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float | None = None,
) -> tuple[DistEnv, torch.device]:
    """Join the process group if a launcher started several processes.

    Returns this process's :class:`DistEnv` and the device it should use. With
    world size 1 no process group is created. ``timeout_s`` (default
    ``$COURSE_DIST_TIMEOUT`` or 120 s) bounds the rendezvous and every
    collective, so a missing peer is an error rather than a hang.
    """
    info = detect_env()
    dev = choose_device(device, info.local_rank)
    if not info.is_distributed or dist.is_initialized():
        return info, dev

    if timeout_s is None:
        timeout_s = float(os.environ.get("COURSE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    # torch's env:// rendezvous reads these; Slurm and MPI do not set them.
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = backend or choose_backend(dev.type)
    try:
        dist.init_process_group(
            backend=backend,
            init_method="env://",
            rank=info.rank,
            world_size=info.world_size,
            timeout=_dt.timedelta(seconds=timeout_s),
        )
    except Exception as exc:  # the raw error names neither the peer nor the address
        raise RuntimeError(
            f"rank {info.rank}/{info.world_size} could not join the process group at "
            f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} within {timeout_s:.0f} s "
            f"(launcher: {info.launcher}). Check that every rank started and that the "
            f"address is reachable from this node. Cause: {exc}"
        ) from exc
    return info, dev


def cleanup() -> None:
    """Leave the process group (if any) so the process exits without warnings."""
    if dist.is_available() and dist.is_initialized():
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


def print0(*args: Any, **kwargs: Any) -> None:
    """``print`` on rank 0 only (every rank printing the same line is noise)."""
    if is_main_process():
        kwargs.setdefault("flush", True)
        print(*args, **kwargs)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, for one rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def describe(info: DistEnv) -> str:
    """One line that says who this process is; handy at the top of a job log."""
    return (
        f"[{socket.gethostname()} pid {os.getpid()}] launcher={info.launcher} "
        f"rank={info.rank}/{info.world_size} local_rank={info.local_rank} "
        f"master={info.master_addr}:{info.master_port} python={sys.executable}"
    )
