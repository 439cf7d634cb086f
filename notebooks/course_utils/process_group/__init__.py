"""Launcher-agnostic process groups, in three parts:

``env``         who this process is, from the launcher's environment (a pure function)
``group``       joining, asking about and leaving the process group (its ``rendezvous``
                meets every rank and places them on devices)
``report``      what the ranks print, and checks across ranks

A plain ``python script.py`` is world size 1 and creates no process group, so
the same script runs on a laptop and under every launcher. As in NERSC's
``utils/comm.py``, :func:`get_rank` and :func:`get_world_size` answer 0 and 1
when no process group exists. A script's whole life in the group::

    with cdist.session(args.device) as (info, device):
        ...
"""

from .env import DistEnv, detect_env, expand_hostlist, free_port, port_from_job_id
from .group import (
    DEFAULT_JOIN_TIMEOUT_S,
    DEFAULT_TIMEOUT_S,
    barrier,
    choose_device,
    cleanup,
    collective_timeout_s,
    get_rank,
    get_world_size,
    init_distributed,
    is_initialized,
    is_main_process,
    parallel_mesh,
    session,
)
from .rendezvous import RendezvousError, listen_failure
from .report import describe, gathered, print0, print_ranks, ranks_agree, ranks_per_host, require_processes

__all__ = [
    "DEFAULT_JOIN_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "DistEnv", "barrier", "choose_device", "cleanup",
    "collective_timeout_s", "describe", "gathered",
    "detect_env", "expand_hostlist", "free_port", "get_rank", "get_world_size", "init_distributed",
    "is_initialized", "is_main_process", "parallel_mesh", "port_from_job_id", "print0", "print_ranks", "ranks_agree",
    "ranks_per_host", "require_processes", "session", "RendezvousError", "listen_failure",
]
