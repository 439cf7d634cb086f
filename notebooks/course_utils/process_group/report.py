"""What the ranks say: one line from rank 0, every rank's line in order, and checks across ranks."""

from __future__ import annotations

import os
import socket
import sys
from collections import Counter
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from .env import DistEnv
from .group import get_world_size, is_initialized, is_main_process


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


def gathered(obj: Any) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (a collective; ``[obj]`` without a group)."""
    if not is_initialized():
        return [obj]
    out: list[Any] = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def ranks_per_host() -> dict[str, int]:
    """How many ranks run on each host (a collective; 1 on this host without a group)."""
    hosts: list[Any] = [socket.gethostname()] * get_world_size()
    if is_initialized():
        dist.all_gather_object(hosts, socket.gethostname())
    return dict(Counter(hosts))


def ranks_agree(model: torch.nn.Module) -> bool:
    """True when every rank holds exactly the same parameters (a collective).

    DDP keeps replicas identical by construction; this proves it at the end of
    a job, where a silent divergence (a rank that skipped a step) would show.
    """
    if not is_initialized():
        return True
    # a sharded parameter (FSDP2's DTensor) is gathered whole first: a collective too, on every rank
    whole = (p.full_tensor() if isinstance(p, DTensor) else p for p in model.parameters())
    flat = torch.cat([p.detach().reshape(-1).double() for p in whole])
    # on the parameters' device: with NCCL, every tensor in a collective lives on the rank's GPU
    digest = torch.stack([flat.sum(), (flat * flat).sum(), flat.abs().max()])
    lo, hi = digest.clone(), digest.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    return bool(torch.equal(lo, hi))


def describe(info: DistEnv) -> str:
    """One line that says who this process is; handy at the top of a job log."""
    return (
        f"[{socket.gethostname()} pid {os.getpid()}] launcher={info.launcher} "
        f"rank={info.rank}/{info.world_size} local_rank={info.local_rank} "
        f"master={info.master_addr}:{info.master_port} python={sys.executable}"
    )
