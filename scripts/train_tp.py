#!/usr/bin/env python
"""Tensor parallelism, Megatron-LM's split: by hand on an MLP, then with DTensor on transformer blocks.

    torchrun --standalone --nproc-per-node=2 scripts/train_tp.py
    torchrun --standalone --nproc-per-node=4 scripts/train_tp.py --hidden 256 --heads 8 --blocks 4
    srun python scripts/train_tp.py                  # 2-D: tensor parallel inside each node, data parallel across

With --tp-size T (default: the ranks of a node, all of them on one node) the ranks form a 2-D mesh ("dp", "tp"),
node-major: consecutive ranks (a node's GPUs under srun or torchrun) share the layers' matrices, and the groups
are data parallel replicas, each training on its share of the batch (slurm/*/multi_node_2d.sbatch: T = the
GPUs of a node).

1. The MLP split by hand (course_utils.tensor_parallel.ColumnRowMLP: fc1 by output features, fc2 by
   input features, one all-reduce forward and one backward) against the unsplit MLP: outputs and
   gradients.
2. --blocks transformer blocks split by DTensor's parallelize_module (q, k, v, fc1 column-parallel;
   o, fc2 row-parallel), twice: each column-parallel layer converting its own input, and the
   attention's and MLP's input entering as one DTensor; the collectives each runs, counted with their
   bytes, forward and backward, beside Megatron's 4 all-reduces per block and step.
3. --steps SGD steps of the blocks under the second plan, each data-parallel group on its share of the
   global batch (gradients averaged across the groups, as DDP does), and of the unsplit blocks on the
   whole global batch: the losses must agree. With --ckpt-dir, training resumes from the sharded
   checkpoint there (torch.distributed.checkpoint: every rank reads and writes its own shards) and
   writes one after the last step.
4. The blocks with sequence parallelism (SequenceParallel on the layer norms, all-gathers and
   reduce-scatters instead of all-reduces), fed this rank's slice of the sequence: the collectives,
   and the activation bytes each plan saves for the backward pass.
5. With a 2-D mesh, FSDP2 composed with the tensor-parallel split (torchtitan's order: parallelize_module
   over "tp", then fully_shard over "dp"), trained --steps steps against the unsplit blocks.
The last line is RESULT {json} (rank 0).
"""

from __future__ import annotations

import argparse
import socket
import sys

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.errors import fail
from course_utils.results import emit_result
from course_utils.tensor_parallel import (
    MLP,
    CollectiveBytes,
    ColumnRowMLP,
    SavedActivations,
    allreduce_theory,
    average_over,
    build_blocks,
    megatron_plan,
    sequence_parallel_plan,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=64, help="model width (default: 64)")
    p.add_argument("--heads", type=int, default=4, help="attention heads; a multiple of the ranks (default: 4)")
    p.add_argument("--blocks", type=int, default=2, help="transformer blocks (default: 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per batch (default: 4)")
    p.add_argument("--seq", type=int, default=16, help="tokens per sequence (default: 16)")
    p.add_argument("--steps", type=int, default=3, help="SGD steps compared with the unsplit blocks (default: 3)")
    p.add_argument("--ckpt-dir", default=None,
                   help="resume from the sharded checkpoint here, if any, and write one at the end (default: none)")
    p.add_argument("--tp-size", type=int, default=None,
                   help="ranks per tensor-parallel group; the groups are data parallel (default: the ranks of a node)")
    add_device_flag(p)
    return p


def biggest_gap(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.detach().float() - b.detach().float()).abs().max().item()


def by_hand(hidden: int, rank: int, ranks: int, x: torch.Tensor, group) -> dict[str, float]:
    """The column/row-split MLP against the whole one: output, input gradient, this rank's weight gradients."""
    torch.manual_seed(1)
    dense = MLP(hidden).to(x.device)
    mine = ColumnRowMLP(dense, rank, ranks, group)
    x_dense, x_mine = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_dense, out_mine = dense(x_dense), mine(x_mine)
    out_dense.square().mean().backward()
    out_mine.square().mean().backward()
    inner = dense.fc1.out_features
    cols = slice(rank * inner // ranks, (rank + 1) * inner // ranks)
    return {"output": biggest_gap(out_dense, out_mine), "input_grad": biggest_gap(x_dense.grad, x_mine.grad),
            "weight_grads": max(biggest_gap(dense.fc1.weight.grad[cols], mine.w1.grad),
                                biggest_gap(dense.fc2.weight.grad[:, cols], mine.w2.grad))}


def with_dtensor(args: argparse.Namespace, mesh, x: torch.Tensor, sum_input_grads: bool) -> dict[str, object]:
    """The blocks under ``megatron_plan``: the collectives forward and backward, and the gaps to the unsplit blocks."""
    from torch.distributed.tensor.parallel import parallelize_module

    dense = build_blocks(args.hidden, args.heads, args.blocks).to(x.device)
    split = parallelize_module(build_blocks(args.hidden, args.heads, args.blocks).to(x.device), mesh,
                               megatron_plan(args.blocks, sum_input_grads))
    x_dense, x_split = x.clone().requires_grad_(), x.clone().requires_grad_()
    with SavedActivations(dense) as saved_dense:
        out_dense = dense(x_dense)
    out_dense.square().mean().backward()
    forward, backward = CollectiveBytes(), CollectiveBytes()
    with forward, SavedActivations(split) as saved:
        out_split = split(x_split)
    with backward:
        out_split.square().mean().backward()
    local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in split.parameters())
    return {"forward": dict(forward.calls), "forward_bytes": dict(forward.bytes),
            "backward": dict(backward.calls), "backward_bytes": dict(backward.bytes),
            "output_gap": biggest_gap(out_dense, out_split), "input_grad_gap": biggest_gap(x_dense.grad, x_split.grad),
            "params_this_rank": local, "params_whole": sum(p.numel() for p in dense.parameters()),
            "saved_bytes": saved.bytes, "saved_bytes_unsplit": saved_dense.bytes}


def with_sequence_parallel(args: argparse.Namespace, mesh, x: torch.Tensor) -> dict[str, object]:
    """The blocks under ``sequence_parallel_plan``, fed this rank's slice of the sequence: the collectives,
    the activation bytes saved for backward, and the gaps to the unsplit blocks on the same slice."""
    from torch.distributed.tensor.parallel import parallelize_module

    t, rank = mesh.size(), mesh.get_local_rank()
    if args.seq % t:
        raise SystemExit(f"error: --seq {args.seq} must be a multiple of the {t} tensor-parallel ranks "
                         "(sequence parallelism splits it)")
    mine = slice(rank * args.seq // t, (rank + 1) * args.seq // t)
    dense = build_blocks(args.hidden, args.heads, args.blocks).to(x.device)
    split = parallelize_module(build_blocks(args.hidden, args.heads, args.blocks).to(x.device), mesh,
                               sequence_parallel_plan(args.blocks))
    x_dense, x_split = x.clone().requires_grad_(), x[:, mine].clone().requires_grad_()
    out_dense = dense(x_dense)
    out_dense.square().mean().backward()
    forward, backward = CollectiveBytes(), CollectiveBytes()
    with forward, SavedActivations(split) as saved:
        out_split = split(x_split)
    with backward:  # each rank's share of the unsplit loss: the sum over the ranks is that loss
        (out_split.square().sum() / out_dense.numel()).backward()
    return {"forward": dict(forward.calls), "forward_bytes": dict(forward.bytes),
            "backward": dict(backward.calls), "backward_bytes": dict(backward.bytes),
            "output_gap": biggest_gap(out_dense[:, mine], out_split),
            "input_grad_gap": biggest_gap(x_dense.grad[:, mine], x_split.grad), "saved_bytes": saved.bytes}


def train_both(args: argparse.Namespace, mesh, device: torch.device) -> tuple[float, list[float], int | None]:
    """--steps SGD steps of the 2-D layout (tensor parallel over mesh["tp"], each data-parallel group on
    --batch sequences of the global batch) and of the unsplit blocks on the whole global batch. With
    --ckpt-dir, both are resumed from the sharded checkpoint found there and saved at the end (every
    rank writes its own shards: torch.distributed.checkpoint). Returns the largest difference of the two
    losses, the global batch's loss of each step trained here, and the step resumed from."""
    from torch import nn
    from torch.distributed.tensor.parallel import parallelize_module

    from course_utils.checkpoint import CheckpointError
    from course_utils.checkpoint import latest_sharded, load_sharded, save_sharded
    from course_utils.trainer import build_optimizer

    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    dense = build_blocks(args.hidden, args.heads, args.blocks).to(device)
    split = parallelize_module(build_blocks(args.hidden, args.heads, args.blocks).to(device), mesh["tp"],
                               megatron_plan(args.blocks))
    both = nn.ModuleDict({"dense": dense, "split": split})  # one checkpoint, one optimizer for the two
    # the split blocks' LayerNorms stay plain tensors beside the DTensors: one group per kind (foreach)
    opt = build_optimizer(both.parameters(), "sgd", lr=0.05, momentum=0.9)
    shape = {k: getattr(args, k) for k in ("hidden", "heads", "blocks", "batch", "seq")}
    start, resumed = 0, None
    found = latest_sharded(args.ckpt_dir) if args.ckpt_dir else None
    if found is not None:
        try:
            progress = load_sharded(found, both, opt)  # each rank reads its shards, whatever wrote them
        except CheckpointError as exc:
            sys.exit(fail(str(exc)))
        if progress["shape"] != shape:
            raise SystemExit(f"error: {found} holds blocks of {progress['shape']}, this run builds {shape}: "
                             "resume with the same shape, or point --ckpt-dir at a new folder")
        start = resumed = progress["step"]
        cdist.print0(f"resumed from {found} after step {start}")
    worst, losses = 0.0, []
    for step in range(start, args.steps):
        gen = torch.Generator().manual_seed(100 + step)  # every rank draws the same global batch
        x = torch.randn(dp * args.batch, args.seq, args.hidden, generator=gen).to(device)
        y = torch.randn(dp * args.batch, args.seq, args.hidden, generator=gen).to(device)
        opt.zero_grad()
        whole = torch.nn.functional.mse_loss(dense(x), y)
        whole.backward()
        mine = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)  # this group's share
        loss = torch.nn.functional.mse_loss(split(x[mine]), y[mine])
        loss.backward()
        average_over(mesh["dp"].get_group(), split, dp)  # DDP's all-reduce, across the groups
        opt.step()
        shared = loss.detach().clone()
        dist.all_reduce(shared, group=mesh["dp"].get_group())  # the global batch's loss: the groups' mean
        losses.append(shared.item() / dp)
        worst = max(worst, abs(whole.item() - losses[-1]))
    if args.ckpt_dir:
        saved = save_sharded(args.ckpt_dir, both, opt, {"step": args.steps, "shape": shape})
        cdist.print0(f"sharded checkpoint after step {args.steps}: {saved}")
    return worst, losses, resumed


def train_fsdp_tp(args: argparse.Namespace, mesh, device: torch.device) -> dict[str, float]:
    """torchtitan's order on the 2-D mesh: tensor parallel over mesh["tp"], then FSDP2 (``fully_shard``, each
    block, then the whole) over mesh["dp"]; --steps SGD steps, each data-parallel group on its share of the
    global batch (FSDP2 averages the gradients across the groups), against the unsplit blocks on the whole
    batch. Returns the largest loss difference and the share of the weights each rank holds."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from course_utils.trainer import build_optimizer

    dp, dp_rank = mesh["dp"].size(), mesh["dp"].get_local_rank()
    dense = build_blocks(args.hidden, args.heads, args.blocks).to(device)
    model = parallelize_module(build_blocks(args.hidden, args.heads, args.blocks).to(device), mesh["tp"],
                               megatron_plan(args.blocks))
    for block in model:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(model, mesh=mesh["dp"])
    opt_dense = build_optimizer(dense.parameters(), "sgd", lr=0.05, momentum=0.9)
    opt = build_optimizer(model.parameters(), "sgd", lr=0.05, momentum=0.9)
    worst = 0.0
    for step in range(args.steps):
        gen = torch.Generator().manual_seed(100 + step)  # the same global batches as train_both
        x = torch.randn(dp * args.batch, args.seq, args.hidden, generator=gen).to(device)
        y = torch.randn(dp * args.batch, args.seq, args.hidden, generator=gen).to(device)
        opt_dense.zero_grad()
        whole = torch.nn.functional.mse_loss(dense(x), y)
        whole.backward()
        opt_dense.step()
        opt.zero_grad()
        mine = slice(dp_rank * args.batch, (dp_rank + 1) * args.batch)
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
        loss.backward()  # FSDP2 reduce-scatters the gradients over "dp", averaged
        opt.step()
        shared = loss.detach().clone()
        dist.all_reduce(shared, group=mesh["dp"].get_group())
        worst = max(worst, abs(whole.item() - shared.item() / dp))
    here = sum(p.to_local().numel() for p in model.parameters())
    return {"loss_gap": worst, "params_this_rank": here, "params_whole": sum(p.numel() for p in dense.parameters())}


def main() -> int:
    args = build_parser().parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "train_tp.py", " (the layers are split over the ranks)")
        ranks = info.world_size
        tp = args.tp_size or info.local_world_size  # tensor parallel inside a node, over its fast links
        if ranks % tp or args.heads % tp or (4 * args.hidden) % tp:
            cdist.print0(f"error: --tp-size {tp} must divide the {ranks} ranks, --heads {args.heads} and 4 x --hidden "
                         f"{4 * args.hidden}: each rank holds whole heads and an equal share of the MLP")
            return 2
        mesh = cdist.parallel_mesh(device, tp)  # node-major: one node's GPUs form a tensor-parallel group
        gen = torch.Generator().manual_seed(0)  # every rank the same input: the whole batch, replicated
        x = torch.randn(args.batch, args.seq, args.hidden, generator=gen).to(device)
        hand = by_hand(args.hidden, mesh["tp"].get_local_rank(), tp, x, mesh["tp"].get_group())
        plans = {"each layer's own input": with_dtensor(args, mesh["tp"], x, False),
                 "inputs as one DTensor": with_dtensor(args, mesh["tp"], x, True),
                 "sequence parallel": with_sequence_parallel(args, mesh["tp"], x)}
        loss_gap, losses, resumed = train_both(args, mesh, device)
        fsdp_tp = train_fsdp_tp(args, mesh, device) if ranks > tp else None  # a 2-D mesh: FSDP2 over dp
        gaps = [None] * ranks
        dist.all_gather_object(gaps, (hand, {k: (v["output_gap"], v["input_grad_gap"]) for k, v in plans.items()},
                                      loss_gap, socket.gethostname()))
        theory = allreduce_theory(args.batch, args.seq, args.hidden, args.blocks, x.element_size())
        for name, r in plans.items():
            cdist.print0(f"DTensor, {name}: forward {r['forward']} {r['forward_bytes']} B, backward {r['backward']} "
                         f"{r['backward_bytes']} B; {r['saved_bytes']:,} B of activations saved for backward")
        cdist.print0(f"Megatron's split: {theory['forward_calls']} all-reduces of {theory['forward_bytes']:,} B forward, "
                     f"{theory['backward_calls']} of {theory['backward_bytes']:,} B backward")
        hosts, per_host = [g[3] for g in gaps], cdist.ranks_per_host()  # (a collective: every rank)
        groups = [hosts[d * tp:(d + 1) * tp] for d in range(ranks // tp)]
        cdist.print0(f"mesh: {ranks // tp} data-parallel group(s) of {tp} tensor-parallel ranks; hosts per group {groups}")
        if info.rank == 0:
            worst_hand = {k: max(g[0][k] for g in gaps) for k in hand}
            emit_result({"script": "train_tp.py", "ranks": ranks, "tp": tp, "dp": ranks // tp,
                         "tp_groups_within_a_host": all(len(set(g)) == 1 for g in groups),
                         "hosts": per_host, "device": str(device), "by_hand": worst_hand,
                         "dtensor": {name: {**r, "output_gap": max(g[1][name][0] for g in gaps),
                                            "input_grad_gap": max(g[1][name][1] for g in gaps)}
                                     for name, r in plans.items()},
                         "theory": theory, "train_loss_gap": max(g[2] for g in gaps), "losses": losses,
                         "fsdp_tp": fsdp_tp,
                         "resumed_from": resumed,
                         "shape": {k: getattr(args, k) for k in ("hidden", "heads", "blocks", "batch", "seq")}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
