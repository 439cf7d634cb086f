#!/usr/bin/env python
"""What DDP guarantees, checked on real processes:

1. after ``backward()`` every rank holds bit-identical gradients (their average),
   although each rank computed on different images;
2. N ranks with batch B per rank take the same steps as 1 process with batch
   N*B: same seed, same images per step, a model whose normalisation does not
   depend on how the batch is split (GroupNorm), no augmentation. The two add
   the same numbers in other orders, so they can only differ by round-off, and
   the check is made where round-off has a size to state: in float64, one
   rounding is 2**-53 = 1.1e-16 of the value, and the parameters must agree to
   FLOAT64_ATOL = 1e-9 (see there). In float32 the same two runs are also
   trained and their distance printed, not checked: float32's round-off
   (6e-8 a rounding) grows with every step, and it can tip a max-pool or a
   ReLU that sits near a tie to the other side, which no bound fixed in
   advance covers over many steps (1e-4 after 20 steps on a CPU here, 2 or 4 ranks).
   Each run also trains a DDP that is wrong on purpose (gradients summed over
   the ranks, not averaged) and shows that it misses by the size of a training
   step, 1e-2 and more: a check that could not fail would pass it too.

    torchrun --standalone --nproc-per-node=4 scripts/ddp_checks.py --steps 5
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, Dataset, DistributedSampler, TensorDataset

from course_utils import process_group as cdist
from course_utils.data import get_datasets, make_loader
from course_utils.devices import add_device_flag
from course_utils.models import build_model
from course_utils.precision import set_tf32
from course_utils.results import emit_result
from course_utils.trainer import TrainConfig, Trainer, make_optimizer

# N x B against 1 x N*B, in float64: u = 2**-53 = 1.1e-16 a rounding. The two runs form the same products and
# add them in other orders (over the ranks, and inside kernels chosen for batch B or N*B). Reordering a sum of K
# terms moves it by at most about 2Ku times the sum of the terms' magnitudes (Higham, Accuracy and Stability of
# Numerical Algorithms, section 4.2, recursive summation); K is largest for the first convolution's weights,
# N*B*32*32 = 131,072 for 8 ranks of 16 images: 3e-11 times that sum, which stays below 0.5 for this model's
# gradients (measured over 20 steps), so 1.5e-11. SGD with lr 0.05 and momentum 0.9 gives one gradient a weight
# of at most 0.05 / (1 - 0.9) = 0.5 in the parameters over all later steps: 20 steps carry at most
# 20 x 0.5 x 1.5e-11 = 1.5e-10. That is a first-order bound (what the network and later steps make of a
# difference comes on top: the margin to 1e-9 is for it); measured on a CPU: 3e-16 after 20 steps, 2 to 4 ranks.
# A wrong average misses by a step's size: the summed control run by 3e-2 and more.
FLOAT64_ATOL = 1e-9


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


def summed_not_averaged(state, bucket):  # no annotations: DDP checks them, and this file's are strings
    """A DDP communication hook that is wrong on purpose: it sums the ranks' gradients and does not
    divide by the world size (DDP's own hook does), so every step is N times too long."""
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def as_dtype(dataset: Dataset, dtype: torch.dtype) -> Dataset:
    """The images of ``dataset`` in ``dtype`` (the labels as they are)."""
    x, y = zip(*(dataset[i] for i in range(len(dataset))))
    return TensorDataset(torch.stack(x).to(dtype), torch.as_tensor(y))


def flat_params(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_ddp(train: Dataset, batch: int, cfg: TrainConfig, device: torch.device, seed: int, dtype: torch.dtype,
              sum_gradients: bool) -> tuple[torch.Tensor, int]:
    """N x B: the course's Trainer (DDP over all ranks), ``batch`` images per rank and step, in ``dtype``."""
    torch.manual_seed(seed)
    trainer = Trainer(build_model("cnn-gn").to(dtype), make_loader(train, batch, shuffle=True, seed=seed), device, cfg)
    if sum_gradients:
        trainer.ddp.register_comm_hook(None, summed_not_averaged)
    trainer.fit()
    return flat_params(trainer.raw_model), trainer.global_step


def train_big_batch(train: Dataset, batch: int, cfg: TrainConfig, device: torch.device, seed: int,
                    dtype: torch.dtype) -> torch.Tensor:
    """1 x N*B: one process, ``batch`` images per step, the same images in the same order, in ``dtype``."""
    torch.manual_seed(seed)
    ref = build_model("cnn-gn").to(device=device, dtype=dtype)
    opt = make_optimizer(ref, cfg, cfg.lr)  # the Trainer's own, so both sides run the same implementation
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    for x, y in DataLoader(train, batch_size=batch, sampler=sampler):
        loss = torch.nn.functional.cross_entropy(ref(x.to(device)), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return flat_params(ref)


def equivalence(device: torch.device, batch: int, steps: int, seed: int) -> dict:
    """Train N x B with the course's Trainer (DDP) and 1 x N*B by hand, in float64 and in float32, and a DDP that sums
    the gradients in float64 (the control); compare parameters."""
    world = dist.get_world_size()
    n_images = world * batch * steps
    train, _, info = get_datasets("synthetic", n_train=n_images, n_val=1, augment=False, seed=seed)
    cfg = TrainConfig(epochs=1, lr=0.05, momentum=0.9, weight_decay=5e-4, progress=False, tf32=False)
    torch.manual_seed(seed)
    initial = flat_params(build_model("cnn-gn")).double().to(device)  # the same weights start every run
    out = {}
    for dtype, name in ((torch.float64, "float64"), (torch.float32, "float32")):
        images = as_dtype(train, dtype)
        ddp_params, out["steps"] = train_ddp(images, batch, cfg, device, seed, dtype, sum_gradients=False)
        gathered = [torch.empty_like(ddp_params) for _ in range(world)]
        dist.all_gather(gathered, ddp_params)
        out[f"ranks_identical_{name}"] = all(torch.equal(gathered[0], g) for g in gathered)
        ref = train_big_batch(images, world * batch, cfg, device, seed, dtype)
        out[f"max_abs_diff_{name}"] = float((ddp_params - ref).abs().max())
        if dtype == torch.float64:
            out["max_moved"] = float((ref - initial).abs().max())  # a check that cannot fail would show ~0 here
            out["max_param"] = float(ref.abs().max())
            summed, _ = train_ddp(images, batch, cfg, device, seed, dtype, sum_gradients=True)
            out["summed_max_abs_diff"] = float((summed - ref).abs().max())  # the control: must miss by far
    return {**out, "max_abs_diff": out["max_abs_diff_float64"],
            "ranks_identical": out["ranks_identical_float64"] and out["ranks_identical_float32"],
            "within_tolerance": out["max_abs_diff_float64"] <= FLOAT64_ATOL}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch-size", type=int, default=16, help="per rank")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    add_device_flag(p)
    args = p.parse_args()
    with cdist.session(args.device) as (info, device):
        cdist.require_processes(2, "ddp_checks.py")
        # float32 as float32: TF32 (PyTorch's default for cuDNN convolutions on Ampere and later) keeps 10
        # mantissa bits inside a convolution; the float64 check does not depend on it (no TF32 for float64).
        set_tf32(False)
        identical, differed = gradients_identical(device, args.batch_size)
        cdist.print0(f"{info.world_size} ranks ({dist.get_backend()}): local gradients differ between ranks: "
                     f"{differed}; after DDP's all-reduce, bit-identical on every rank: {identical}")
        eq = equivalence(device, args.batch_size, args.steps, args.seed)
        cdist.print0(
            f"{info.world_size} ranks x batch {args.batch_size} vs 1 process x batch "
            f"{info.world_size * args.batch_size}, {eq['steps']} SGD steps: max |difference| "
            f"{eq['max_abs_diff_float64']:.2e} in float64, within {FLOAT64_ATOL:g}: {eq['within_tolerance']} "
            f"(in float32: {eq['max_abs_diff_float32']:.2e}, round-off grown by training); "
            f"training moved parameters by up to {eq['max_moved']:.2e}; a DDP that sums the gradients instead "
            f"of averaging them misses by {eq['summed_max_abs_diff']:.2e}; all ranks identical: {eq['ranks_identical']}"
        )
        ok = (identical and differed and eq["within_tolerance"] and eq["ranks_identical"]
              and eq["max_moved"] > 1e6 * FLOAT64_ATOL and eq["summed_max_abs_diff"] > 1e6 * FLOAT64_ATOL)
        emit_result({"world_size": info.world_size, "grads_identical": identical, "local_grads_differed": differed,
                     **eq, "float64_atol": FLOAT64_ATOL, "ok": ok})
        return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
