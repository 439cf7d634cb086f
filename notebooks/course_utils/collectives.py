"""Collectives by hand, and how to measure them.

``ring_all_reduce`` is the algorithm NCCL and gloo use for large messages,
written with point-to-point sends: split the buffer into N chunks, then

1. reduce-scatter: N-1 steps; in each, every rank sends one chunk to its right
   neighbour and adds the chunk arriving from its left. Afterwards rank r
   holds the full sum of chunk (r+1) mod N.
2. all-gather: N-1 more steps passing the finished chunks around the ring.

Each rank sends 2(N-1) chunks of size S/N: ``2(N-1)/N * S`` bytes in all,
which tends to 2S however many ranks there are. That is why the ring is
bandwidth-optimal, and why *bus bandwidth* (algorithm bandwidth times
2(N-1)/N) is the number to compare with a link's speed.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist

# nccl-tests' factors: bus bandwidth = algorithm bandwidth x factor(N)
BUS_FACTORS: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "reduce": lambda n: 1.0,
}


def chunk_bounds(numel: int, world: int) -> list[tuple[int, int]]:
    """Split ``numel`` elements into ``world`` contiguous chunks whose sizes
    differ by at most one (sizes need not divide evenly)."""
    base, extra = divmod(numel, world)
    bounds, start = [], 0
    for i in range(world):
        size = base + (1 if i < extra else 0)
        bounds.append((start, start + size))
        start += size
    return bounds


def ring_all_reduce(tensor: torch.Tensor, sent: list[int] | None = None) -> torch.Tensor:
    """Sum ``tensor`` over all ranks in place, with send/recv around a ring.

    ``sent``: a list to append the bytes of every message this rank sends (what
    notebook 02's exercise is checked against)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if world == 1:
        return tensor
    flat = tensor.view(-1)  # in place: a view of the caller's memory
    bounds = chunk_bounds(flat.numel(), world)
    right, left = (rank + 1) % world, (rank - 1) % world
    recv_buf = torch.empty(max(b - a for a, b in bounds), dtype=flat.dtype, device=flat.device)

    def exchange(send_idx: int, recv_idx: int) -> torch.Tensor:
        s0, s1 = bounds[send_idx]
        r0, r1 = bounds[recv_idx]
        incoming = recv_buf[: r1 - r0]
        outgoing = flat[s0:s1].contiguous()
        # Send right and receive from the left as one batch: every rank posts both at once,
        # so no rank blocks in a send its neighbour is not yet receiving (with NCCL and
        # 3+ ranks, a blocking send before the receive can deadlock the whole ring).
        ops = [dist.P2POp(dist.isend, outgoing, right), dist.P2POp(dist.irecv, incoming, left)]
        if sent is not None:
            sent.append(outgoing.numel() * outgoing.element_size())
        for req in dist.batch_isend_irecv(ops):
            req.wait()
        return incoming

    # reduce-scatter: at step k, send chunk (rank - k) and accumulate chunk (rank - k - 1)
    for k in range(world - 1):
        send_idx, recv_idx = (rank - k) % world, (rank - k - 1) % world
        r0, r1 = bounds[recv_idx]
        flat[r0:r1] += exchange(send_idx, recv_idx)
    # all-gather: rank now owns the full sum of chunk (rank + 1); pass finished chunks on
    for k in range(world - 1):
        send_idx, recv_idx = (rank + 1 - k) % world, (rank - k) % world
        r0, r1 = bounds[recv_idx]
        flat[r0:r1] = exchange(send_idx, recv_idx)
    return tensor


def bytes_sent_per_rank(op: str, nbytes: int, world: int) -> float:
    """Bytes each rank sends in a bandwidth-optimal implementation of ``op``."""
    return BUS_FACTORS[op](world) * nbytes


def time_op(fn: Callable[[], object], device: torch.device, iters: int = 10, untimed_calls: int = 2) -> float:
    """Mean seconds per call of a collective, all ranks lined up by a barrier first."""
    for _ in range(untimed_calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    # the slowest rank defines the collective's time
    t = torch.tensor([elapsed / iters], dtype=torch.float64)
    if dist.get_backend() == "nccl":
        t = t.to(device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def bandwidths(op: str, nbytes: int, seconds: float, world: int) -> tuple[float, float]:
    """(algorithm bandwidth, bus bandwidth) in GB/s, as nccl-tests reports them."""
    alg = nbytes / seconds / 1e9
    return alg, alg * BUS_FACTORS[op](world)
