"""Every rank meets every other through a TCP store before the process group exists.

What this relies on in torch (``tests/test_torch_contract.py`` pins it, so an
upgrade that changes it fails a test rather than a job): under ``torchrun``
the workers get ``TORCHELASTIC_USE_AGENT_STORE=True`` and the agent serves a
store at ``MASTER_ADDR:MASTER_PORT``; after a worker-group restart the same
store serves the new workers and ``TORCHELASTIC_RESTART_COUNT`` has grown.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import socket
from collections.abc import Mapping
from typing import Any

import torch.distributed as dist

from ..devices import Placement, PlacementError, RankView, local_view, place_ranks
from ..waiting import wait_until
from .env import DistEnv

JOIN_KEY = "course/join/"


class RendezvousError(RuntimeError):
    """The ranks did not all meet; the message names who is missing and where."""


def listen_refused(port: int | str) -> str:
    """The one line for a rank 0 that cannot listen on the rendezvous port: another process holds it."""
    return (f"rank 0 on {socket.gethostname().split('.')[0]} could not listen on port {port} (MASTER_PORT): another "
            "process holds it. Start the job again (the course's launchers and sbatch scripts choose a port free at "
            "the start), or name a free one: COURSE_MASTER_PORT for a course sbatch script, --master-port for torchrun")


def listen_failure(exc: BaseException) -> str | None:
    """:func:`listen_refused` where ``exc`` is torch's failure to listen on MASTER_PORT (a framework's own process
    group, Lightning's or Fabric's, raises it with a traceback), else None."""
    text = str(exc)
    if isinstance(exc, dist.DistNetworkError) and ("EADDRINUSE" in text or "failed to listen" in text):
        return listen_refused(os.environ.get("MASTER_PORT", "?"))
    return None


def agent_store_in_use(env: Mapping[str, str]) -> bool:
    """True under torchrun: its agent already serves the store, every rank is a client."""
    return env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"


def attempt_prefix(env: Mapping[str, str]) -> str:
    """The key space of this worker-group attempt: a restarted group reuses the agent's
    store, where the dead group's keys (ours, gloo's and NCCL's addresses) still are."""
    return f"course/attempt_{env.get('TORCHELASTIC_RESTART_COUNT', '0')}"


def _connect(info: DistEnv, join_timeout_s: float) -> dist.Store:
    addr, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    is_server = info.rank == 0 and not agent_store_in_use(os.environ)
    try:
        store = dist.TCPStore(addr, port, info.world_size, is_server, timeout=_dt.timedelta(seconds=join_timeout_s),
                              wait_for_workers=False)
    except Exception as exc:
        if is_server:
            raise RendezvousError(listen_refused(port)) from exc
        raise RendezvousError(
            f"rank {info.rank}/{info.world_size} could not reach rank 0's rendezvous at {addr}:{port} "
            f"within {join_timeout_s:.0f} s. Is rank 0 running, and is {addr} reachable from "
            f"{socket.gethostname()}? (launcher: {info.launcher}; cause: {exc})"
        ) from exc
    return dist.PrefixStore(attempt_prefix(os.environ), store)


def _place_all(store: dist.Store, info: DistEnv, join_timeout_s: float, device: str) -> dict[str, Any]:
    """Rank 0: wait for every rank's view, or name the ones that never came; place them all."""
    missing = list(range(1, info.world_size))

    def all_joined() -> bool:
        missing[:] = [r for r in missing if not store.check([JOIN_KEY + str(r)])]
        return not missing

    def never_joined() -> RendezvousError:
        names = ", ".join(map(str, missing[:16])) + (" ..." if len(missing) > 16 else "")
        return RendezvousError(
            f"rank(s) {names} of {info.world_size} never joined the rendezvous at {os.environ['MASTER_ADDR']}:"
            f"{os.environ['MASTER_PORT']} within {join_timeout_s:.0f} s. Check that every process was started "
            "(srun/torchrun task count) and can reach it; raise $COURSE_JOIN_TIMEOUT if they start slowly."
        )

    wait_until(all_joined, join_timeout_s, never_joined, interval_s=0.05)
    views = []
    for r in range(info.world_size):
        seen = json.loads(store.get(JOIN_KEY + str(r)))
        views.append(RankView(seen["host"], tuple(seen["gpus"])))
    try:
        placements = place_ranks(views, device, dist.is_nccl_available())
        return {"placements": [[p.device, p.backend, p.note] for p in placements]}
    except (PlacementError, ValueError) as exc:
        return {"error": str(exc)}


def rendezvous(info: DistEnv, join_timeout_s: float, device: str) -> tuple[dist.Store, Placement]:
    """Meet every rank, or say which ranks never came; every rank gets the same placement.

    Each rank checks in with what it sees (host, GPUs); rank 0 waits for all of
    them and places every rank (:func:`course_utils.devices.place_ranks`) so that
    all ranks get one answer: their device and the backend, or the same error.
    """
    store = _connect(info, join_timeout_s)
    view = local_view()
    store.set(JOIN_KEY + str(info.rank), json.dumps({"host": view.host, "gpus": list(view.gpus)}))
    if info.rank == 0:
        plan = _place_all(store, info, join_timeout_s, device)
        store.set(JOIN_KEY + "all", json.dumps(plan))
    else:
        try:
            store.wait([JOIN_KEY + "all"], _dt.timedelta(seconds=join_timeout_s))
        except Exception as exc:
            raise RendezvousError(
                f"rank {info.rank}/{info.world_size} reached {os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']} "
                f"but the other ranks did not all arrive within {join_timeout_s:.0f} s (rank 0 reports which): {exc}"
            ) from exc
        plan = json.loads(store.get(JOIN_KEY + "all"))
    if "error" in plan:
        raise PlacementError(plan["error"])
    return store, Placement(*plan["placements"][info.rank])
