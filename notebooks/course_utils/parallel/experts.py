"""Expert parallelism: a mixture-of-experts MLP whose experts live on different ranks (Shazeer et al., 2017;
GShard; torchtitan's ``docs/dist_moe.md``).

A router scores every token against ``E`` experts (SwiGLU MLPs) and sends it to its ``top_k``, its output the
experts' outputs weighted by the router's normalised scores. Each expert takes at most ``capacity`` tokens a
step (``capacity_factor`` x its even share); the rest are dropped (they skip the layer: the residual carries
them). An auxiliary loss, ``E x sum_e f_e P_e`` (the share of tokens sent to expert ``e`` times its mean router
probability; Switch Transformer's), pulls the router towards even loads.

Spread over ``ep`` ranks, each rank holds ``E / ep`` experts. A step's tokens travel twice: ``all_to_all_single``
sends each token to the rank of its expert (dispatch), and again back (combine), each with the split sizes the
ranks first exchange; autograd runs both backwards.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


# the bytes this rank's all-to-alls have sent to other ranks since the last reset (forward: dispatch and
# combine; each backward sends as many again): what a run counts against all_to_all_bytes
SENT = {"dispatch": 0, "combine": 0}


def capacity_for(factor: float, tokens: int, experts: int, top_k: int) -> int:
    """An expert's capacity: ``factor`` times its even share of the assignments, ``tokens x top_k / experts``,
    rounded up (a hair of float rounding forgiven, so that a factor computed as a ratio lands on its integer)."""
    return math.ceil(factor * tokens * top_k / experts - 1e-9)


class MoE(nn.Module):
    """``experts`` SwiGLU experts of ``hidden`` units, ``top_k`` per token. ``capacity_factor=None``: no token is
    dropped (each expert may take every token)."""

    def __init__(self, dim: int, hidden: int, experts: int, top_k: int = 2,
                 capacity_factor: float | None = None) -> None:
        super().__init__()
        self.experts, self.top_k, self.capacity_factor = experts, top_k, capacity_factor
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.w3 = nn.Parameter(torch.randn(experts, hidden, dim) * 0.02)
        self.w2 = nn.Parameter(torch.randn(experts, dim, hidden) * 0.02)
        self.ep_group = None  # set by apply_ep: this rank then holds only its experts' rows of w1, w3, w2
        self.aux_loss = torch.zeros(())
        self.stats: dict = {}

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:  # e: the expert's row on this rank
        return F.linear(F.silu(F.linear(x, self.w1[e])) * F.linear(x, self.w3[e]), self.w2[e])

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each (token, choice) pair: its token, its expert and its weight, the pairs over capacity left out; the
        auxiliary loss and the load per expert kept in ``aux_loss`` and ``stats``."""
        probs = self.router(tokens).float().softmax(-1)
        weight, expert = probs.topk(self.top_k, dim=-1)
        weight = weight / weight.sum(-1, keepdim=True)
        n = tokens.shape[0]
        load = torch.bincount(expert.flatten(), minlength=self.experts)
        self.aux_loss = self.experts * ((load.float() / (n * self.top_k)) * probs.mean(0)).sum()
        capacity = n * self.top_k if self.capacity_factor is None else capacity_for(
            self.capacity_factor, n, self.experts, self.top_k)
        token = torch.arange(n, device=tokens.device).repeat_interleave(self.top_k)
        expert, weight = expert.flatten(), weight.flatten()
        order = torch.argsort(expert, stable=True)  # the pairs grouped by expert, in token order within each
        token, expert, weight = token[order], expert[order], weight[order]
        starts = torch.cumsum(load, 0) - load
        place = torch.arange(expert.numel(), device=tokens.device) - starts[expert]  # arrival order at its expert
        kept = place < capacity
        self.stats = {"load": load.tolist(), "capacity": capacity, "dropped": int((~kept).sum())}
        return token[kept], expert[kept], weight[kept]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        token, expert, weight = self.route(tokens)
        inputs = tokens[token]  # one row per kept (token, choice) pair, grouped by expert
        counts = torch.bincount(expert, minlength=self.experts)
        outputs = self._experts_here(inputs, counts) if self.ep_group is None else self._across_ranks(inputs, counts)
        out = torch.zeros_like(tokens, dtype=outputs.dtype).index_add(0, token, outputs * weight[:, None].to(outputs))
        return out.to(x.dtype).reshape(shape)

    def _experts_here(self, inputs: torch.Tensor, counts: torch.Tensor, first: int = 0) -> torch.Tensor:
        """Every expert on this rank over its rows of ``inputs`` (grouped by expert, ``counts`` each)."""
        pieces = inputs.split(counts.tolist())
        return torch.cat([self._expert(first + e, piece) for e, piece in enumerate(pieces)]) if pieces else inputs

    def _across_ranks(self, inputs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Dispatch each row to the rank of its expert, run the experts there, and combine: two all-to-alls."""
        from torch.distributed._functional_collectives import all_to_all_single_autograd, wait_tensor

        group = self.ep_group
        ranks = dist.get_world_size(group)
        local = self.experts // ranks
        # how many rows each rank sends to each expert of every rank: exchanged first (the split sizes)
        sent = counts.view(ranks, local)
        received = torch.empty_like(sent)
        dist.all_to_all_single(received, sent, group=group)
        send_sizes, recv_sizes = sent.sum(1).tolist(), received.sum(1).tolist()
        me, row = dist.get_rank(group), inputs.shape[-1] * inputs.element_size()
        SENT["dispatch"] += (sum(send_sizes) - send_sizes[me]) * row  # rows for other ranks' experts
        SENT["combine"] += (sum(recv_sizes) - recv_sizes[me]) * row  # the other ranks' rows, sent back
        # dispatch: each row to its expert's rank, arriving grouped by source rank, then by expert
        arrived = wait_tensor(all_to_all_single_autograd(inputs.contiguous(), recv_sizes, send_sizes, group))
        # regroup by expert (as _experts_here expects), run them, and undo the regrouping
        by_source = arrived.split(received.flatten().tolist())  # (source, expert) blocks
        order = [s * local + e for e in range(local) for s in range(ranks)]
        grouped = torch.cat([by_source[i] for i in order]) if by_source else arrived
        done = self._experts_here(grouped, received.sum(0), first=0)
        pieces = done.split([received.flatten().tolist()[i] for i in order])
        back = [None] * len(order)
        for piece, i in zip(pieces, order, strict=True):
            back[i] = piece
        returned = torch.cat(back) if back else done
        # combine: every row back to the rank of its token, in the order it left
        return wait_tensor(all_to_all_single_autograd(returned.contiguous(), send_sizes, recv_sizes, group))


def router_load(model: nn.Module) -> list[int] | None:
    """The assignments per expert that this rank's routers made in their last forward, summed over the
    mixtures of ``model`` (before any capacity drops them); None for a dense model."""
    loads = [m.stats["load"] for m in model.modules() if isinstance(m, MoE) and m.stats]
    return [sum(column) for column in zip(*loads)] if loads else None


def expert_params(model: nn.Module) -> list[nn.Parameter]:
    """The experts' weights of every mixture in ``model`` that :func:`apply_ep` spread: each rank holds others."""
    return [p for m in model.modules() if isinstance(m, MoE) and m.ep_group is not None for p in (m.w1, m.w3, m.w2)]


def reduce_expert_grads(model: nn.Module, dp: int, replicate_group=None) -> None:
    """Make the spread experts' gradients the mean over the data-parallel ranks, as FSDP2 makes the others':
    an expert's gradient already sums every ep rank's tokens (the all-to-all's backward brought them); replicas
    of it (HSDP's ``dp_replicate``) add theirs; then divide by the data-parallel ranks."""
    for p in expert_params(model):
        if p.grad is None:
            continue
        if replicate_group is not None:
            dist.all_reduce(p.grad, group=replicate_group)
        p.grad.div_(dp)


def apply_ep(moe: MoE, ep_mesh) -> None:
    """Keep only this rank's ``E / ep`` experts of ``moe`` (consecutive rows), and dispatch over ``ep_mesh``."""
    ranks, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    if moe.experts % ranks:
        raise ValueError(f"--ep {ranks} does not divide the {moe.experts} experts: each rank holds experts/ep")
    local = moe.experts // ranks
    for name in ("w1", "w3", "w2"):
        whole = getattr(moe, name)
        setattr(moe, name, nn.Parameter(whole.detach()[rank * local:(rank + 1) * local].clone()))
    moe.ep_group = ep_mesh.get_group()


def all_to_all_bytes(load: list[int], ranks: int, rank: int, dim: int, element_bytes: int = 4) -> int:
    """The bytes rank ``rank``'s dispatch sends to other ranks (its rows for their experts; combine sends as many
    back). ``load``: its rows per expert, all ``E`` of them."""
    local = len(load) // ranks
    return sum(n for e, n in enumerate(load) if e // local != rank) * dim * element_bytes
