"""A small Llama-style decoder, the transformer the course's parallelisms split (``scripts/train_lm.py``).

Llama's parts, each a few lines: RMSNorm before attention and before the MLP, rotary position embeddings
(RoPE), causal attention with grouped-query heads (``kv_heads`` key/value heads shared by ``heads / kv_heads``
query heads each) through ``scaled_dot_product_attention``, and a SwiGLU MLP; no biases. The names are
torchtitan's (``tok_embeddings``, ``layers``, ``attention.wq`` ...), so its plans read as ours. The layers
sit in a ``ModuleDict`` keyed "0", "1", ...: a pipeline stage deletes the layers it does not hold, and
the names of the rest (and of their checkpoint entries) do not change.

Attention views its projections as ``(-1, head_dim)``: under tensor parallelism each rank holds
``heads / tp`` query heads and ``kv_heads / tp`` key/value heads (its columns of ``wq``, ``wk``, ``wv``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaShape:
    """The decoder's sizes. ``ffn_hidden``: SwiGLU's inner width (Llama: about 8/3 x dim, rounded)."""

    dim: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    ffn_hidden: int = 176
    vocab: int = 256  # byte-level tokens: no tokenizer to download
    tied: bool = False  # the head uses the embedding's weights
    rope_theta: float = 10_000.0
    norm_eps: float = 1e-5
    experts: int = 0  # above 0: each MLP a mixture of this many SwiGLU experts (course_utils.parallel.experts)
    top_k: int = 2  # experts per token

    def __post_init__(self) -> None:
        if self.dim % self.heads or self.heads % self.kv_heads or (self.dim // self.heads) % 2:
            raise ValueError(f"heads ({self.heads}) must divide dim ({self.dim}) into an even head size, and "
                             f"kv_heads ({self.kv_heads}) must divide heads")

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


LM_SIZES = {  # --lm-size: CI's seconds on two cores, then what a GPU node trains for real
    "tiny": LlamaShape(),
    "small": LlamaShape(dim=256, layers=4, heads=8, kv_heads=4, ffn_hidden=688),
    "base": LlamaShape(dim=768, layers=12, heads=12, kv_heads=4, ffn_hidden=2048),
}


def rope(x: torch.Tensor, theta: float, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate each pair of ``x``'s features (batch, heads, tokens, head_dim) by the token's position
    times a frequency that falls along the pairs (Su et al., 2021): attention scores then depend on
    the distance between two tokens, not on where they sit. ``positions``: the tokens' places in the whole
    sequence (a context-parallel rank holds a share of it), else 0, 1, ..."""
    tokens, dim = x.shape[-2], x.shape[-1]
    freqs = theta ** -(torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    where = torch.arange(tokens, device=x.device) if positions is None else positions.to(x.device)
    angles = torch.outer(where.float(), freqs)
    cos, sin = angles.cos(), angles.sin()
    even, odd = x.float()[..., 0::2], x.float()[..., 1::2]
    return torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.head_dim, self.theta = s.head_dim, s.rope_theta
        self.wq = nn.Linear(s.dim, s.heads * s.head_dim, bias=False)
        self.wk = nn.Linear(s.dim, s.kv_heads * s.head_dim, bias=False)
        self.wv = nn.Linear(s.dim, s.kv_heads * s.head_dim, bias=False)
        self.wo = nn.Linear(s.heads * s.head_dim, s.dim, bias=False)
        self.context = None  # context parallel (course_utils.parallel.context): (group, layout, positions)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = (proj(x).view(b, t, -1, self.head_dim).transpose(1, 2) for proj in (self.wq, self.wk, self.wv))
        where = self.context[2] if self.context else None
        q, k = rope(q, self.theta, where), rope(k, self.theta, where)
        k, v = (z.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for z in (k, v))  # each kv head to its queries
        if self.context:  # this rank holds a share of the sequence: its queries meet every key round the ring
            from .parallel.context import ring_attention

            group, layout, where = self.context
            y = ring_attention(q, k, v, where.to(q.device), group, layout)
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    """SwiGLU: ``w2(silu(w1(x)) * w3(x))``."""

    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.w1 = nn.Linear(s.dim, s.ffn_hidden, bias=False)
        self.w3 = nn.Linear(s.dim, s.ffn_hidden, bias=False)
        self.w2 = nn.Linear(s.ffn_hidden, s.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, s: LlamaShape) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(s.dim, eps=s.norm_eps), Attention(s)
        self.ffn_norm = nn.RMSNorm(s.dim, eps=s.norm_eps)
        if s.experts:
            from .parallel.experts import MoE

            self.feed_forward = MoE(s.dim, s.ffn_hidden, s.experts, s.top_k)
        else:
            self.feed_forward = FeedForward(s)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Llama(nn.Module):
    """Tokens (batch, seq) in, logits (batch, seq, vocab) out. A pipeline stage without the embedding takes
    the previous stage's hidden states instead; one without the head returns its own."""

    def __init__(self, shape: LlamaShape) -> None:
        super().__init__()
        self.shape = shape
        self.tok_embeddings: nn.Module | None = nn.Embedding(shape.vocab, shape.dim)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(shape) for i in range(shape.layers)})
        self.norm: nn.Module | None = nn.RMSNorm(shape.dim, eps=shape.norm_eps)
        self.output: nn.Module | None = nn.Linear(shape.dim, shape.vocab, bias=False)
        if shape.tied:
            self.output.weight = self.tok_embeddings.weight
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2's scheme: small normal weights, the projections into the residual stream scaled down with depth
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / (2 * self.shape.layers) ** 0.5 if name.endswith(("wo.weight", "w2.weight")) else 0.02
                nn.init.normal_(p, std=std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_llama(size: str | LlamaShape = "tiny", seed: int = 0, **changes: int | bool) -> Llama:
    """The decoder of ``LM_SIZES[size]`` (or a shape), with ``changes`` to its fields (``tied=True``),
    its weights drawn from ``seed``: the same on every rank and in every layout."""
    if isinstance(size, str):
        if size not in LM_SIZES:
            raise ValueError(f"unknown --lm-size {size!r}; choose one of: {', '.join(LM_SIZES)}")
        size = LM_SIZES[size]
    torch.manual_seed(seed)
    return Llama(LlamaShape(**{**asdict(size), **changes}))


def parameter_counts(shape: LlamaShape) -> dict[str, int]:
    """Parameters in the embedding, the layers, the final norm and the head (the head's 0 when tied)."""
    return {"embedding": shape.vocab * shape.dim, "layers": shape.layers * _layer_weights(shape), "norm": shape.dim,
            "head": 0 if shape.tied else shape.vocab * shape.dim}


def _layer_weights(shape: LlamaShape, active: bool = False) -> int:
    """One block's weights; ``active``: those one token meets (a mixture: the router and its top-k experts)."""
    d, kv = shape.dim, shape.kv_heads * shape.head_dim
    mlp = 3 * d * shape.ffn_hidden
    if shape.experts:
        mlp = (shape.top_k if active else shape.experts) * mlp + d * shape.experts
    return 2 * d * d + 2 * d * kv + mlp + 2 * d


def flops_per_token(shape: LlamaShape, seq_len: int) -> int:
    """Forward and backward FLOPs per token, as torchtitan and picotron count them for MFU: 6 per weight the
    token meets (2 forward, 4 backward: a multiply and an add per weight; the embedding's lookup is no
    matmul), plus attention's two matmuls, ``q k^T`` and ``scores v``: 2 x 2 x seq x dim per layer forward,
    3x that with the backward (12 x layers x dim x seq; causal masking's halving left out, as both do)."""
    # the head's matmul, tied or not; a mixture's token meets only its top-k experts
    weights = shape.layers * _layer_weights(shape, active=True) + shape.dim + shape.vocab * shape.dim
    return 6 * weights + 12 * shape.layers * shape.dim * seq_len
