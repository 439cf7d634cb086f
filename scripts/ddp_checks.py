#!/usr/bin/env python
"""What DDP guarantees, checked on real processes:

1. after ``backward()`` every rank holds bit-identical gradients (their average),
   although each rank computed on different images;
2. N ranks with batch B per rank take the same steps as 1 process with batch
   N*B: same seed, same images per step, a model whose normalisation does not
   depend on how the batch is split (GroupNorm), no augmentation. The only
   difference is the order of floating-point sums, hence a stated tolerance.

    torchrun --standalone --nproc-per-node=4 scripts/ddp_checks.py --steps 5
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

from course_utils import dist as cdist
from course_utils.data import get_datasets, make_loader
from course_utils.devices import add_device_flag
from course_utils.models import build_model
from course_utils.precision import set_tf32
from course_utils.results import emit_result
from course_utils.trainer import TrainConfig, Trainer, make_optimizer

ATOL, RTOL = 1e-5, 1e-4  # float32, a few SGD steps


def flat_grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()])


def gradients_identical(device: torch.device, batch: int) -> tuple[bool, bool]:
    """(DDP gradients identical on all ranks, local gradients differed before averaging)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = DDP(build_model("cnn").to(device), device_ids=[device.index] if device.type == "cuda" else None)
    g = torch.Generator().manual_seed(100 + rank)  # different images on every rank
    x = torch.randn(batch, 3, 32, 32, generator=g).to(device)
    y = torch.randint(0, 10, (batch,), generator=g).to(device)
    loss_fn = torch.nn.CrossEntropyLoss()
    with model.no_sync():  # local gradients only: what each rank computed on its own
        loss_fn(model(x), y).backward()
    local = flat_grads(model.module).clone()
    model.zero_grad(set_to_none=True)
    loss_fn(model(x), y).backward()  # this time DDP all-reduces during backward
    synced = flat_grads(model.module)
    gathered_local = [torch.empty_like(local) for _ in range(world)]
    gathered = [torch.empty_like(synced) for _ in range(world)]
    dist.all_gather(gathered_local, local)
    dist.all_gather(gathered, synced)
    identical = all(torch.equal(gathered[0], g_) for g_ in gathered)
    differed = any(not torch.equal(gathered_local[0], g_) for g_ in gathered_local[1:])
    mean_local = torch.stack(gathered_local).mean(0)
    assert torch.allclose(synced, mean_local, atol=1e-6, rtol=1e-4), "DDP's gradient is the mean of the ranks'"
    return identical, differed


def equivalence(device: torch.device, batch: int, steps: int, seed: int) -> dict:
    """Train N x B with the course's Trainer (DDP) and 1 x N*B by hand; compare parameters."""
    world = dist.get_world_size()
    n_images = world * batch * steps
    train, _, info = get_datasets("synthetic", n_train=n_images, n_val=1, augment=False, seed=seed)
    cfg = TrainConfig(epochs=1, lr=0.05, momentum=0.9, weight_decay=5e-4, progress=False, tf32=False)
    torch.manual_seed(seed)
    trainer = Trainer(build_model("cnn-gn"), make_loader(train, batch, shuffle=True, seed=seed), device, cfg)
    trainer.fit()
    ddp_params = torch.cat([p.detach().reshape(-1) for p in trainer.raw_model.parameters()])
    gathered = [torch.empty_like(ddp_params) for _ in range(world)]
    dist.all_gather(gathered, ddp_params)
    ranks_identical = all(torch.equal(gathered[0], g) for g in gathered)

    # The reference: one process, the whole global batch per step, same image order.
    torch.manual_seed(seed)
    ref = build_model("cnn-gn").to(device)
    initial = torch.cat([p.detach().reshape(-1) for p in ref.parameters()]).clone()
    opt = make_optimizer(ref, cfg, cfg.lr)  # the Trainer's own, so both sides run the same implementation
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    for x, y in DataLoader(train, batch_size=world * batch, sampler=sampler):
        loss = torch.nn.functional.cross_entropy(ref(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    ref_params = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    diff = (ddp_params - ref_params).abs()
    close = torch.allclose(ddp_params, ref_params, atol=ATOL, rtol=RTOL)
    moved = float((ref_params - initial).abs().max())  # a check that cannot fail would show ~0 here
    return {"steps": trainer.global_step, "ranks_identical": ranks_identical, "max_abs_diff": float(diff.max()),
            "max_moved": moved,
            "max_param": float(ref_params.abs().max()), "within_tolerance": bool(close)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    add_device_flag(p)
    args = p.parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "ddp_checks.py")
        # A float32-sized tolerance needs float32 math: TF32 (PyTorch's default for cuDNN
        # convolutions on Ampere and later) keeps 10 mantissa bits and would exceed it.
        set_tf32(False)
        identical, differed = gradients_identical(device, args.batch_size)
        cdist.print0(f"{info.world_size} ranks ({dist.get_backend()}): local gradients differ between ranks: "
                     f"{differed}; after DDP's all-reduce, bit-identical on every rank: {identical}")
        eq = equivalence(device, args.batch_size, args.steps, args.seed)
        cdist.print0(
            f"{info.world_size} ranks x batch {args.batch_size} vs 1 process x batch "
            f"{info.world_size * args.batch_size}, {eq['steps']} SGD steps: max |difference| "
            f"{eq['max_abs_diff']:.2e} (training moved parameters by up to {eq['max_moved']:.2e}); "
            f"within atol={ATOL:g}, rtol={RTOL:g}: {eq['within_tolerance']}; "
            f"all ranks identical: {eq['ranks_identical']}"
        )
        ok = (identical and differed and eq["within_tolerance"] and eq["ranks_identical"]
              and eq["max_moved"] > 100 * ATOL)
        emit_result({"world_size": info.world_size, "grads_identical": identical,
                     "local_grads_differed": differed, **eq, "ok": ok})
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
