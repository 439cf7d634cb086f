#!/usr/bin/env python
"""The course's one training program.

The same file runs everywhere; only the launcher changes::

    python scripts/train.py --epochs 2                      # laptop, one GPU
    torchrun --standalone --nproc-per-node=4 scripts/train.py   # one node
    srun python scripts/train.py                            # Slurm, a task per GPU

Rank, world size and device come from the launcher's environment
(course_utils.dist); nothing here is chosen by hand. The last line printed is
``RESULT {json}`` with the final metrics, for notebooks and tests to read.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time

import torch

from course_utils import dist as cdist
from course_utils.checkpoint import ensure_writable_dir
from course_utils.data import DATASETS, DatasetMissingError, get_datasets, make_loader
from course_utils.models import MODELS, build_model, count_parameters
from course_utils.trainer import PRECISIONS, TrainConfig, Trainer, history_table, scaled_lr


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = p.add_argument_group("data")
    d.add_argument("--dataset", choices=DATASETS, default="synthetic",
                   help="synthetic needs no download (default); cifar10/mnist: see course_utils.data")
    d.add_argument("--data-root", default=None, help="folder with the data (default $COURSE_DATA or data/)")
    d.add_argument("--n-train", type=positive_int, default=None, help="use only this many training images")
    d.add_argument("--n-val", type=positive_int, default=None, help="use only this many validation images")
    d.add_argument("--workers", type=non_negative_int, default=2, help="DataLoader workers per rank")
    d.add_argument("--pin-memory", action="store_true", help="page-locked host memory (GPU only)")
    m = p.add_argument_group("model and optimisation")
    m.add_argument("--model", choices=MODELS, default="cnn")
    m.add_argument("--epochs", type=positive_int, default=2)
    m.add_argument("--batch-size", type=positive_int, default=128, help="per rank; global = this x world size")
    m.add_argument("--lr", type=positive_float, default=0.05)
    m.add_argument("--grad-accum", type=positive_int, default=1, help="micro-batches per optimiser step")
    m.add_argument("--scale-lr", action="store_true",
                   help="linear scaling rule: lr x world size x grad-accum (lr is per rank-batch)")
    m.add_argument("--warmup-epochs", type=float, default=0.0, help="linear lr warm-up")
    m.add_argument("--steps-per-epoch", type=positive_int, default=None, help="cap batches per epoch")
    m.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("speed")
    s.add_argument("--device", default="auto", help="auto (default), cpu, cuda or cuda:N")
    s.add_argument("--precision", choices=PRECISIONS, default="fp32")
    s.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=None,
                   help="TF32 tensor cores for fp32 matmuls and convolutions (Ampere+); default: PyTorch's "
                        "(convolutions only)")
    s.add_argument("--cudnn-benchmark", action="store_true", help="autotune cuDNN convolutions")
    s.add_argument("--channels-last", action="store_true")
    s.add_argument("--compile", action="store_true", help="torch.compile the model")
    s.add_argument("--bucket-cap-mb", type=positive_float, default=25.0, help="DDP gradient bucket size")
    s.add_argument("--grad-as-bucket-view", action="store_true", help="DDP: gradients as views into buckets")
    o = p.add_argument_group("output")
    o.add_argument("--ckpt-dir", default=None, help="write last.pt here each epoch; resume from it")
    o.add_argument("--ckpt-every-steps", type=positive_int, default=None,
                   help="also write last.pt every N optimiser steps (a killed job then loses at most N steps)")
    o.add_argument("--log-dir", default=None, help="TensorBoard event files")
    o.add_argument("--no-progress", action="store_true", help="no progress bar (batch jobs)")
    return p


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # Folders first: an unwritable path is an error before any work is done.
    try:
        for folder, what in ((args.ckpt_dir, "checkpoint folder"), (args.log_dir, "log folder")):
            if folder:
                ensure_writable_dir(folder, what)
        info, device = cdist.init_distributed(args.device)
    except (PermissionError, ValueError) as exc:
        return fail(str(exc))
    except RuntimeError as exc:
        return fail(str(exc), code=1)

    try:
        cdist.print0(cdist.describe(info))
        hosts = cdist.ranks_per_host()
        cdist.print0("ranks per host: " + ", ".join(f"{h} x{n}" for h, n in sorted(hosts.items())))
        torch.manual_seed(args.seed)  # same initial weights on every rank
        try:
            train_ds, val_ds, meta = get_datasets(
                args.dataset, args.data_root, args.n_train, args.n_val, seed=args.seed
            )
        except DatasetMissingError as exc:
            return fail(str(exc))
        pin = args.pin_memory and device.type == "cuda"
        train_loader = make_loader(train_ds, args.batch_size, shuffle=True, workers=args.workers,
                                   pin_memory=pin, persistent_workers=args.workers > 0,
                                   drop_last=True, seed=args.seed)
        val_loader = make_loader(val_ds, 2 * args.batch_size, shuffle=False, workers=args.workers,
                                 pin_memory=pin, seed=args.seed)
        model = build_model(args.model, meta.channels, meta.num_classes)
        cdist.print0(
            f"{args.model}: {count_parameters(model) / 1e6:.2f} M parameters on {device}; "
            f"{args.dataset}: {len(train_ds)} train / {len(val_ds)} val images; "
            f"global batch {args.batch_size * info.world_size * args.grad_accum}, "
            f"lr {scaled_lr(args.lr, info.world_size, args.grad_accum) if args.scale_lr else args.lr:g}"
        )
        lr = scaled_lr(args.lr, info.world_size, args.grad_accum) if args.scale_lr else args.lr
        config = TrainConfig(
            epochs=args.epochs, lr=lr, warmup_epochs=args.warmup_epochs,
            bucket_cap_mb=args.bucket_cap_mb, grad_as_bucket_view=args.grad_as_bucket_view,
            precision=args.precision, tf32=args.tf32,
            cudnn_benchmark=args.cudnn_benchmark, channels_last=args.channels_last,
            compile=args.compile, grad_accum=args.grad_accum,
            steps_per_epoch=args.steps_per_epoch, log_dir=args.log_dir, ckpt_dir=args.ckpt_dir,
            ckpt_every_steps=args.ckpt_every_steps,
            progress=not args.no_progress and sys.stderr.isatty(),
        )
        try:
            trainer = Trainer(model, train_loader, device, config, val_loader=val_loader)
        except ValueError as exc:  # e.g. bf16 on a GPU without it
            return fail(str(exc))
        # Slurm's warning before the time limit (--signal=USR1@120, or passed on by the batch
        # shell): checkpoint at the next step and stop, so the requeued job loses seconds.
        trainer.stop.install(signal.SIGUSR1)
        start = time.perf_counter()
        history = trainer.fit()
        agree = cdist.ranks_agree(trainer.raw_model)
        cdist.print0(history_table(history))
        cdist.print0(f"all {info.world_size} ranks hold identical parameters: {agree}")
        last = history[-1] if history else None
        result = {
            "world_size": info.world_size,
            "hosts": hosts,
            "ranks_agree": agree,
            "device": str(device),
            "lr": lr,
            "epochs": trainer.epoch,
            "stopped": trainer.stopped,
            "train_loss": [h.train_loss for h in history],
            "val_acc": last.val_acc if last else None,
            "images_per_s_per_rank": last.images_per_s if last else None,
            "seconds": time.perf_counter() - start,
        }
        cdist.print0("RESULT " + json.dumps(result))
        return 0
    finally:
        cdist.cleanup()


if __name__ == "__main__":
    sys.exit(main())
