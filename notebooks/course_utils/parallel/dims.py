"""How the ranks are split: :class:`ParallelDims`, validated against the world size and the model, and the one
named ``DeviceMesh`` every parallelism takes its ranks from (torchtitan's ``parallel_dims.py``).

The mesh is ``(pp, dp_replicate, dp_shard, cp, tp)``, outermost first. Tensor parallelism is innermost: its ranks
talk every layer, so they are neighbours (``tp`` consecutive ranks, one node's GPUs under torchrun's and
Slurm's numbering); the data-parallel ranks talk once a step; pipeline stages send one activation per
micro-batch to the next stage, the least traffic of all, so they may span nodes. ``dp_shard`` ranks shard
the weights (FSDP2), ``dp_replicate`` groups of them hold replicas (HSDP: shard within a node, replicate across nodes).
``cp`` ranks split each sequence (context parallel, ring attention); for the weights they are data-parallel ranks
that saw other tokens of the same sequences, so FSDP2 shards over ``dp_shard x cp`` (torchtitan's ``dp_shard_cp``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..llama import LlamaShape

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")


@dataclass(frozen=True)
class ParallelDims:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1  # expert-parallel ranks, borrowed from dp_shard (torchtitan's way): each holds experts / ep

    @property
    def world_size(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.cp * self.tp

    @property
    def dp(self) -> int:
        """Data-parallel ranks: each takes its own share of a step's batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp * self.cp > 1

    @property
    def ep_enabled(self) -> bool:
        return self.ep > 1

    @property
    def cp_enabled(self) -> bool:
        return self.cp > 1

    @property
    def hsdp_enabled(self) -> bool:
        return self.dp_replicate > 1

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def pp_enabled(self) -> bool:
        return self.pp > 1

    def problems(self, world_size: int, shape: LlamaShape | None = None, batch: int | None = None,
                 microbatches: int = 1, seq_len: int | None = None) -> list[str]:
        """What does not fit, one line each (empty: the layout runs): the degrees against the world size, what
        tensor parallelism splits (query and key/value heads, SwiGLU's width, the vocabulary), the blocks the
        pipeline cuts and a rank's ``batch`` it cuts into ``microbatches``."""
        found = [f"{name} must be at least 1, got {value}" for name, value in
                 zip(MESH_DIMS, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp), strict=True)
                 if value < 1]
        if not found and self.world_size != world_size:
            found.append(f"--pp {self.pp} x --dp-replicate {self.dp_replicate} x --dp-shard {self.dp_shard} x "
                         f"--cp {self.cp} x --tp {self.tp} = {self.world_size} ranks, but {world_size} were started: "
                         "make the product the world size")
        if self.ep > 1:
            if self.ep != self.dp_shard or self.cp > 1 or self.tp > 1 or self.pp > 1:
                found.append(f"--ep {self.ep} spreads the experts over the --dp-shard ranks: give --dp-shard {self.ep} "
                             "(with --dp-replicate if you like), and no --cp, --tp or --pp with it here")
            if shape is not None and (not shape.experts or shape.experts % self.ep):
                found.append(f"--ep {self.ep} needs --experts, a multiple of {self.ep} (each rank holds experts/ep)")
        if self.cp > 1 and seq_len is not None and seq_len % (2 * self.cp):
            found.append(f"--seq-len {seq_len} does not split into 2 x --cp = {2 * self.cp} chunks (the zig-zag split "
                         "of context parallel): make it a multiple")
        if self.pp > 1:
            if shape is not None and shape.layers < self.pp:
                found.append(f"--pp {self.pp} needs at least a block per stage; the model has {shape.layers}")
            if shape is not None and shape.tied:
                found.append("a tied embedding and head cannot be cut by --pp (the first stage holds one, the last "
                             "the other): train untied")
            if batch is not None and batch % microbatches:
                found.append(f"--batch-size {batch} does not split into --microbatches {microbatches}: make it a "
                             "multiple")
        if shape is not None and self.tp > 1:
            for what, size in (("heads", shape.heads), ("kv_heads", shape.kv_heads), ("ffn_hidden", shape.ffn_hidden),
                               ("vocab", shape.vocab)):
                if size % self.tp:
                    found.append(f"--tp {self.tp} does not divide the model's {what} ({size}): each rank holds "
                                 f"{what}/tp of them")
            if shape.tied:
                found.append("a tied embedding and head cannot be split by --tp (the embedding is split by rows of "
                             "the vocabulary, the head by its outputs): train untied")
        return found

    def validate(self, world_size: int, shape: LlamaShape | None = None, batch: int | None = None,
                 microbatches: int = 1, seq_len: int | None = None) -> None:
        """Raise ValueError with every problem in one line each."""
        found = self.problems(world_size, shape, batch, microbatches, seq_len)
        if found:
            raise ValueError("; ".join(found))

    def build_mesh(self, device: torch.device):
        """The named mesh over every rank: ``mesh["pp"]``, ``mesh["tp"]``, ``mesh["dp_shard"]``,
        ``mesh["dp_replicate", "dp_shard"]`` (HSDP's 2-D mesh)."""
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (self.pp, self.dp_replicate, self.dp_shard, self.cp, self.tp),
                                mesh_dim_names=MESH_DIMS)
        mesh["dp_shard", "cp"]._flatten("dp_shard_cp")  # FSDP2's ranks when context parallel splits the sequences
        return mesh

    def fsdp_mesh(self, mesh):
        """The mesh FSDP2 shards over: ``dp_shard x cp`` flattened, with ``dp_replicate`` outside it (HSDP)."""
        return mesh["dp_replicate", "dp_shard_cp"] if self.hsdp_enabled else mesh["dp_shard_cp"]

    def dp_index(self, mesh) -> int:
        """This rank's place among the data-parallel ranks: which share of the batch it takes."""
        return mesh["dp_replicate"].get_local_rank() * self.dp_shard + mesh["dp_shard"].get_local_rank()
