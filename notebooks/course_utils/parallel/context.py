"""Context parallelism: each rank holds a share of the sequence, and attention runs as a ring (Liu et al., 2023;
picotron's ``context_parallel.py``).

A rank's queries must meet every key. Each of ``N`` steps, every rank attends its queries to the key/value block
it holds, then passes that block to the next rank and receives one from the previous; after ``N - 1`` passes
each query has met every block. The partial results merge exactly through their log-sum-exps (the online
softmax of flash attention). The backward pass runs the ring again and carries each block's key and value
gradients with it, back to the block's owner.

With a causal mask a contiguous split unbalances the ranks: the rank holding the first tokens attends to one
block, the last rank to all ``N``. The zig-zag split cuts the sequence into ``2N`` chunks and gives rank ``r``
chunks ``r`` and ``2N - 1 - r``: every rank then does the same work. torch's own
``torch.distributed.tensor.experimental.context_parallel`` does this through CUDA's attention kernels only.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

LAYOUTS = ("contiguous", "zigzag")


def chunk_ids(layout: str, rank: int, ranks: int) -> list[int]:
    """The chunks of the sequence rank ``rank`` holds: one of ``ranks`` (contiguous), or two of ``2 ranks``."""
    if layout == "contiguous":
        return [rank]
    if layout == "zigzag":
        return [rank, 2 * ranks - 1 - rank]
    raise ValueError(f"a context-parallel layout is one of {', '.join(LAYOUTS)}, not {layout!r}")


def positions(layout: str, rank: int, ranks: int, seq_len: int) -> torch.Tensor:
    """The global positions of rank ``rank``'s tokens, in the order it holds them."""
    chunks = len(chunk_ids(layout, 0, ranks)) * ranks
    if seq_len % chunks:
        raise ValueError(f"--seq-len {seq_len} does not split into {chunks} chunks ({layout}, {ranks} ranks): make "
                         f"it a multiple of {chunks}")
    size = seq_len // chunks
    return torch.cat([torch.arange(c * size, (c + 1) * size) for c in chunk_ids(layout, rank, ranks)])


def shard(x: torch.Tensor, layout: str, rank: int, ranks: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s share of ``x`` along ``dim`` (a sequence dimension)."""
    return x.index_select(dim, positions(layout, rank, ranks, x.shape[dim]).to(x.device))


# this rank's attention work since the last reset: the seconds it spent computing blocks (forward and backward,
# the sends left out) and the query-key pairs its forward computed (a block's masked pairs too): how a split
# balances the ranks
WORK = {"seconds": 0.0, "pairs": 0}


def _timed(fn):
    """``fn``, its seconds added to WORK (a GPU synchronised around it, so that they are its own)."""
    import functools
    import time

    @functools.wraps(fn)
    def timed(*args):
        cuda = args[0].is_cuda
        if cuda:
            torch.cuda.synchronize(args[0].device)
        start = time.perf_counter()
        out = fn(*args)
        if cuda:
            torch.cuda.synchronize(args[0].device)
        WORK["seconds"] += time.perf_counter() - start
        return out
    return timed


@_timed
def _block(q, k, v, q_pos, k_pos, scale):
    """One block of causal attention: its output normalised within the block and its rows' log-sum-exp (-inf for
    rows that see none of the block's keys, whose output is 0)."""
    WORK["pairs"] += q.shape[-2] * k.shape[-2]  # per sequence and head
    scores = (q @ k.transpose(-2, -1)) * scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1, keepdim=True)
    weights = torch.exp(scores - lse.nan_to_num(neginf=0.0)).masked_fill(torch.isinf(lse), 0.0)
    return weights @ v, lse


# the bytes this rank has sent round the ring since the last reset, by pass: what a run counts against ring_bytes
SENT = {"forward": 0, "backward": 0}


def _rotate(tensors: list[torch.Tensor], group, phase: str = "forward") -> list[torch.Tensor]:
    """Send ``tensors`` to the next rank of ``group``'s ring and return the previous rank's (counted in SENT)."""
    SENT[phase] += sum(t.numel() * t.element_size() for t in tensors)
    rank, ranks = dist.get_rank(group), dist.get_world_size(group)
    nxt, prev = dist.get_global_rank(group, (rank + 1) % ranks), dist.get_global_rank(group, (rank - 1) % ranks)
    received = [torch.empty_like(t) for t in tensors]
    ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prev, group) for r in received]
    for work in dist.batch_isend_irecv(ops):
        work.wait()
    return received


@_timed
def _block_grads(qf, kf, vf, q_pos, k_pos, scale, lse, dout, delta):
    """One block's gradients for the queries, keys and values, from the whole row's log-sum-exp (flash
    attention's backward: the block's probabilities recomputed, never stored)."""
    scores = (qf @ kf.transpose(-2, -1)) * scale
    scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
    probs = torch.exp(scores - lse)  # the softmax over the whole sequence, this block's columns
    dscores = probs * (dout @ vf.transpose(-2, -1) - delta)
    return dscores @ kf * scale, dscores.transpose(-2, -1) @ qf * scale, probs.transpose(-2, -1) @ dout


class RingAttention(torch.autograd.Function):
    """Causal attention of this rank's queries over the whole sequence, its keys and values passed round the
    ring. ``q, k, v``: (batch, heads, local tokens, head_dim); ``q_pos``: their global positions."""

    @staticmethod
    def forward(ctx, q, k, v, q_pos, group, layout):
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        scale, c = q.shape[-1] ** -0.5, len(chunk_ids(layout, rank, ranks))  # c: the chunks a rank holds
        rows = list(zip(q.float().chunk(c, dim=2), q_pos.chunk(c)))
        outs, lses = [None] * c, [None] * c
        kv = [k, v]
        for step in range(ranks):
            k_pos = positions(layout, (rank - step) % ranks, ranks, q_pos.numel() * ranks).to(q.device)
            for i, (qi, qpi) in enumerate(rows):  # each chunk of queries meets the key chunks the mask leaves it
                keep = [j for j, kp in enumerate(k_pos.chunk(c)) if kp.min() <= qpi.max()]
                if not keep:
                    continue
                ks, vs = (torch.cat([t.float().chunk(c, dim=2)[j] for j in keep], dim=2) for t in kv)
                part, part_lse = _block(qi, ks, vs, qpi, torch.cat([k_pos.chunk(c)[j] for j in keep]), scale)
                if lses[i] is None:  # the first block is this rank's own: every row sees at least itself
                    outs[i], lses[i] = part, part_lse
                else:  # the online softmax: both partial results reweighted by the merged log-sum-exp
                    merged = torch.logaddexp(lses[i], part_lse)
                    outs[i] = outs[i] * torch.exp(lses[i] - merged) + part * torch.exp(part_lse - merged)
                    lses[i] = merged
            if step < ranks - 1:
                kv = _rotate(kv, group)
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, q_pos, out, lse)
        ctx.group, ctx.layout = group, layout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, q_pos, out, lse = ctx.saved_tensors
        group, layout = ctx.group, ctx.layout
        rank, ranks = dist.get_rank(group), dist.get_world_size(group)
        scale, c = q.shape[-1] ** -0.5, len(chunk_ids(layout, rank, ranks))
        qf, dout = q.float(), grad_out.float()
        delta = (dout * out).sum(-1, keepdim=True)  # flash attention's D: rowsum(dO * O)
        dq = torch.zeros_like(qf)
        rows = list(zip(qf.chunk(c, dim=2), q_pos.chunk(c), lse.chunk(c, dim=2), dout.chunk(c, dim=2),
                        delta.chunk(c, dim=2), dq.chunk(c, dim=2)))  # dq's chunks: views, added to in place
        kv, dkv = [k, v], [torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)]
        for step in range(ranks):
            k_pos = positions(layout, (rank - step) % ranks, ranks, q_pos.numel() * ranks).to(q.device)
            for qi, qpi, lse_i, dout_i, delta_i, dq_i in rows:  # the pairs the forward computed, in its order
                keep = [j for j, kp in enumerate(k_pos.chunk(c)) if kp.min() <= qpi.max()]
                if not keep:
                    continue
                ks, vs = (torch.cat([t.float().chunk(c, dim=2)[j] for j in keep], dim=2) for t in kv)
                d_q, d_k, d_v = _block_grads(qi, ks, vs, qpi, torch.cat([k_pos.chunk(c)[j] for j in keep]), scale,
                                             lse_i, dout_i, delta_i)
                dq_i += d_q
                for grads, d in zip(dkv, (d_k, d_v)):  # each kept key chunk's share, into its place in the block
                    for j, piece in zip(keep, d.chunk(len(keep), dim=2)):
                        grads.chunk(c, dim=2)[j].add_(piece)
            # the block and the gradients gathered for it so far go on; the last pass takes the gradients home
            if step < ranks - 1:
                kv, dkv = _rotate(kv, group, "backward"), _rotate(dkv, group, "backward")
            else:
                dkv = _rotate(dkv, group, "backward")
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, group,
                   layout: str = "zigzag") -> torch.Tensor:
    """Causal attention over the whole sequence for this rank's share of it (see :class:`RingAttention`)."""
    return RingAttention.apply(q, k, v, q_pos, group, layout)


def attention_work(layout: str, ranks: int, seq_len: int) -> list[int]:
    """The query-key pairs each rank's causal attention computes (its share of the triangle), per rank."""
    total = []
    for rank in range(ranks):
        q = positions(layout, rank, ranks, seq_len)
        total.append(int(sum((q + 1).tolist())))  # a query at position p sees p + 1 keys
    return total


def computed_pairs(layout: str, ranks: int, seq_len: int) -> list[int]:
    """The query-key pairs each rank's forward computes per attention layer (per sequence and head), skipping
    the chunk pairs the causal mask leaves empty (a chunk: a rank's share, or half of it under zigzag) and
    computing the rest whole, masked pairs too."""
    chunks = len(chunk_ids(layout, 0, ranks))
    size = seq_len // (chunks * ranks)
    return [size * size * sum(1 for mine in chunk_ids(layout, rank, ranks) for other in range(ranks)
                              for theirs in chunk_ids(layout, other, ranks) if theirs <= mine) for rank in range(ranks)]


def ring_bytes(k: torch.Tensor, v: torch.Tensor, ranks: int) -> dict[str, int]:
    """What one rank sends per attention layer: its K and V blocks, ``ranks - 1`` times forward; backward the
    blocks again and their gradients ``ranks`` times (fp32 here, as the ring accumulates them)."""
    block = k.numel() * k.element_size() + v.numel() * v.element_size()
    return {"forward": (ranks - 1) * block, "backward": (ranks - 1) * block + ranks * (k.numel() + v.numel()) * 4}


def apply_cp(model, cp_mesh, seq_len: int, layout: str = "zigzag") -> None:
    """Make every attention layer of ``model`` attend round ``cp_mesh``'s ring, this rank holding its share of
    ``seq_len`` tokens (the inputs must be cut with :func:`shard`, the same ``layout``)."""
    rank, ranks = cp_mesh.get_local_rank(), cp_mesh.size()
    where = positions(layout, rank, ranks, seq_len)
    for block in model.layers.values():
        attention = block.attention if hasattr(block, "attention") else block._checkpoint_wrapped_module.attention
        attention.context = (cp_mesh.get_group(), layout, where)
