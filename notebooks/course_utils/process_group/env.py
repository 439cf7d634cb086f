"""Who this process is, read from whichever launcher started it: a pure function of the environment.

One process per device, whoever started it: ``torchrun`` (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``), Slurm's ``srun`` (``SLURM_PROCID``,
``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``, the node list) or OpenMPI's
``mpirun`` (``OMPI_COMM_WORLD_*``). A plain ``python script.py`` is world
size 1, so the same script runs on a laptop and under every launcher.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass

import hostlist


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


def expand_hostlist(nodes: str) -> list[str]:
    """Expand a Slurm host list into host names, in Slurm's order (python-hostlist does the parsing).

    >>> expand_hostlist("n[1-3,5]")
    ['n1', 'n2', 'n3', 'n5']
    >>> expand_hostlist("r[1-2]n[01-02]")
    ['r1n01', 'r1n02', 'r2n01', 'r2n02']
    """
    try:
        return hostlist.expand_hostlist(nodes)
    except hostlist.BadHostlist as exc:
        raise ValueError(f"bad Slurm host list {nodes!r}: {exc}") from exc


def port_from_job_id(job_id: int | str, base: int = 20000, span: int = 20000) -> int:
    """A rendezvous port derived from the Slurm job id, for a bare ``srun`` without
    ``MASTER_PORT``: two jobs sharing a node never pick the same one (unlike 29500).
    The course's sbatch scripts choose a free port on the first node instead."""
    return base + int(job_id) % span


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now, for one rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


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

    for launcher, rank, local_rank, world, local_world in (
        ("torchrun", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"),
        ("mpi", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE",
         "OMPI_COMM_WORLD_LOCAL_SIZE"),
    ):
        if rank in env and (launcher == "mpi" or world in env):
            return DistEnv(rank=_int(env, rank, 0), local_rank=_int(env, local_rank, 0),
                           world_size=_int(env, world, 1), local_world_size=_int(env, local_world, 1),
                           master_addr=addr, master_port=port, launcher=launcher)

    # Slurm's variables become torchrun's in one place: the course's sbatch scripts start every srun task through
    # slurm/lib/torch_env.sh (and choose MASTER_ADDR/MASTER_PORT once, in course_job.sh's course_rendezvous), so
    # their ranks arrive in the torchrun branch above. This branch is the fallback for an `srun python script.py`
    # of your own without it: the step's first node as MASTER_ADDR, a port from the job id.
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
        return DistEnv(rank=_int(env, "SLURM_PROCID", 0), local_rank=_int(env, "SLURM_LOCALID", 0),
                       world_size=world, local_world_size=max(1, world // nodes),
                       master_addr=addr, master_port=port, launcher="slurm")

    return DistEnv(master_addr=addr, master_port=port)
