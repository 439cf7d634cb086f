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

import atexit
import datetime as _dt
import gc
import itertools
import json
import os
import re
import socket
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .devices import Placement, PlacementError, RankView, local_view, place_ranks

DEFAULT_TIMEOUT_S = 600
"""Seconds a collective may wait for a peer (``$COURSE_DIST_TIMEOUT``): long
enough for rank 0 to write a large checkpoint while the others wait."""

DEFAULT_JOIN_TIMEOUT_S = 45
"""Seconds every rank may take to arrive at the start (``$COURSE_JOIN_TIMEOUT``)."""


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
def choose_device(requested: str = "auto") -> torch.device:
    """The device of a single process: ``auto`` is its first GPU if it sees one, else the CPU.

    ``cuda`` without a GPU is an error that says so, rather than a crash deep
    inside the first kernel launch. Several ranks are placed together by
    :func:`course_utils.devices.place_ranks` during the rendezvous.
    """
    return torch.device(place_ranks([local_view()], requested)[0].device)


# --------------------------------------------------------------------------- #
# Process group lifecycle
# --------------------------------------------------------------------------- #
def _rendezvous(info: DistEnv, join_timeout_s: float, device: str) -> tuple[dist.Store, Placement]:
    """Meet every rank through a TCP store, or say which ranks never came.

    Under torchrun the agent already serves the store at MASTER_PORT, so every
    rank is a client; otherwise rank 0 serves it. Each rank checks in with what
    it sees (host, GPUs); rank 0 waits for all of them, names the ones missing
    at the deadline, and places every rank (:func:`place_ranks`) so that all
    ranks get one answer: their device and the backend, or the same error.
    """
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
    is_server = info.rank == 0 and not agent_store
    timeout = _dt.timedelta(seconds=join_timeout_s)
    try:
        store = dist.TCPStore(addr, port, info.world_size, is_server, timeout=timeout,
                              wait_for_workers=False)
    except Exception as exc:
        if is_server:
            raise RuntimeError(
                f"rank 0 could not listen on {addr}:{port} ({exc}). Another job may hold the port: "
                "let the launcher choose one (course_utils.launch, or MASTER_PORT derived from the "
                "Slurm job id) instead of a fixed 29500."
            ) from exc
        raise RuntimeError(
            f"rank {info.rank}/{info.world_size} could not reach rank 0's rendezvous at {addr}:{port} "
            f"within {join_timeout_s:.0f} s. Is rank 0 running, and is {addr} reachable from "
            f"{socket.gethostname()}? (launcher: {info.launcher}; cause: {exc})"
        ) from exc
    # A restarted torchrun worker group reuses the agent's store: every key of this
    # attempt (ours and gloo/NCCL's addresses) must live apart from the last attempt's,
    # or the new ranks would dial the dead ones (torch's env:// handler does the same).
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
    prefix = "course/join/"
    view = local_view()
    store.set(prefix + str(info.rank), json.dumps({"host": view.host, "gpus": list(view.gpus)}))
    if info.rank == 0:
        deadline = time.monotonic() + join_timeout_s
        missing = list(range(1, info.world_size))
        while missing:
            missing = [r for r in missing if not store.check([prefix + str(r)])]
            if missing and time.monotonic() > deadline:
                names = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
                raise RuntimeError(
                    f"rank(s) {names} of {info.world_size} never joined the rendezvous at {addr}:{port} "
                    f"within {join_timeout_s:.0f} s. Check that every process was started (srun/torchrun "
                    f"task count) and can reach {addr}; raise $COURSE_JOIN_TIMEOUT if they start slowly."
                )
            if missing:
                time.sleep(0.05)
        views = []
        for r in range(info.world_size):
            seen = json.loads(store.get(prefix + str(r)))
            views.append(RankView(seen["host"], tuple(seen["gpus"])))
        try:
            plan: dict[str, Any] = {"placements": [
                [p.device, p.backend, p.note] for p in place_ranks(views, device, dist.is_nccl_available())]}
        except (PlacementError, ValueError) as exc:
            plan = {"error": str(exc)}
        store.set(prefix + "all", json.dumps(plan))
    else:
        try:
            store.wait([prefix + "all"], timeout)
        except Exception as exc:
            raise RuntimeError(
                f"rank {info.rank}/{info.world_size} reached {addr}:{port} but the other ranks did not all "
                f"arrive within {join_timeout_s:.0f} s (rank 0 reports which): {exc}"
            ) from exc
        plan = json.loads(store.get(prefix + "all"))
    if "error" in plan:
        raise PlacementError(plan["error"])
    return store, Placement(*plan["placements"][info.rank])


def init_distributed(
    device: str = "auto",
    backend: str | None = None,
    timeout_s: float | None = None,
    join_timeout_s: float | None = None,
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
    """
    info = detect_env()
    if not info.is_distributed or dist.is_initialized():
        return info, choose_device(device)

    if timeout_s is None:
        timeout_s = float(os.environ.get("COURSE_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    if join_timeout_s is None:
        join_timeout_s = float(os.environ.get("COURSE_JOIN_TIMEOUT", DEFAULT_JOIN_TIMEOUT_S))
    # Slurm and MPI do not set these; torch's rendezvous needs them.
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", str(info.master_port))
    store, placement = _rendezvous(info, join_timeout_s, device)
    dev = torch.device(placement.device)
    if placement.note and info.rank == 0:
        print(f"note: {placement.note}", file=sys.stderr, flush=True)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    atexit.register(_release_at_exit)
    dist.init_process_group(
        backend=backend or placement.backend,
        store=store,
        rank=info.rank,
        world_size=info.world_size,
        timeout=_dt.timedelta(seconds=timeout_s),
        # NCCL then knows each rank's GPU for barrier() and object collectives, instead of guessing
        device_id=dev if dev.type == "cuda" else None,
    )
    return info, dev


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


def cleanup() -> None:
    """Leave the process group (if any) so the process exits without warnings.

    All ranks meet at a barrier first, so none tears down its connections while
    a peer is still using them. After an error on one rank, the others would
    wait there; it is skipped then (``sys.exc_info()`` is set in ``finally``).
    """
    if dist.is_available() and dist.is_initialized():
        if sys.exc_info()[0] is None:
            try:
                dist.barrier()
            except Exception:
                pass
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


def require_processes(minimum: int, script: str, why: str = "") -> None:
    """Stop with a usage message (exit 2) unless at least ``minimum`` processes run."""
    if get_world_size() < minimum:
        print(f"error: {script} needs at least {minimum} processes{why}; start it under a launcher, e.g.\n"
              f"  torchrun --standalone --nproc-per-node={max(minimum, 2)} scripts/{script}", file=sys.stderr)
        raise SystemExit(2)


def print_ranks(text: str) -> None:
    """Print every rank's ``text`` from rank 0, in rank order.

    A collective: every rank must call it. Lines printed by each rank directly
    would interleave at random through the launcher's pipes.
    """
    if not is_initialized():
        print(text, flush=True)
        return
    texts: list[Any] = [None] * get_world_size()
    dist.all_gather_object(texts, text)
    if is_main_process():
        print("\n".join(str(t) for t in texts), flush=True)


def ranks_per_host() -> dict[str, int]:
    """How many ranks run on each host (a collective; 1 on this host without a group)."""
    hosts: list[Any] = [socket.gethostname()] * get_world_size()
    if is_initialized():
        dist.all_gather_object(hosts, socket.gethostname())
    counts: dict[str, int] = {}
    for h in hosts:
        counts[h] = counts.get(h, 0) + 1
    return counts


def ranks_agree(model: torch.nn.Module) -> bool:
    """True when every rank holds exactly the same parameters (a collective).

    DDP keeps replicas identical by construction; this proves it at the end of
    a job, where a silent divergence (a rank that skipped a step) would show.
    """
    if not is_initialized():
        return True
    flat = torch.cat([p.detach().reshape(-1).double() for p in model.parameters()])
    # on the parameters' device: with NCCL, every tensor in a collective lives on the rank's GPU
    digest = torch.stack([flat.sum(), (flat * flat).sum(), flat.abs().max()])
    lo, hi = digest.clone(), digest.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


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
