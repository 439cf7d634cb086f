"""Command line: ``python -m course_utils.data download cifar10 --root DIR`` (on a login node; ``tinyshakespeare``
for scripts/train_lm.py's --text);
``python -m course_utils.data shard synthetic --out DIR`` (tar shards, notebook 10)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sources import DatasetMissingError, default_data_root, download, get_datasets


def _every(seconds: float, line: str):
    """A progress callback that prints ``line.format(done, total)`` at most every ``seconds`` (a long write says
    where it is; a short one stays quiet)."""
    import time

    last = [time.monotonic()]

    def report(done: int, total: int) -> None:
        if done < total and time.monotonic() - last[0] >= seconds:
            last[0] = time.monotonic()
            print(line.format(f"{done:,}", f"{total:,}"), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.data",
        description="Fetch the course's data sets (on a login node) or check they are in place.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd, help_ in (("download", "download a data set"), ("check", "check it is on disk")):
        p = sub.add_parser(cmd, help=help_)
        p.add_argument("name", choices=("cifar10", "mnist", "tinyshakespeare") if cmd == "download"
                       else ("cifar10", "mnist"))
        p.add_argument("--root", type=Path, default=default_data_root(),
                       help="target folder (default: $COURSE_DATA or the repo's data/)")
    p = sub.add_parser("shard", help="write a data set as tar shards, OUT/train and OUT/val (notebook 10; "
                                     "train.py --dataset shards --data-root OUT)")
    p.add_argument("name", choices=("synthetic", "mnist-idx", "cifar10", "mnist"))
    p.add_argument("--out", type=Path, required=True, help="folder for train/ and val/, each with shards.json")
    p.add_argument("--per-shard", type=int, default=None,
                   help="samples per shard (default: chosen for the data set, and printed; any size trains on any "
                        "number of ranks and workers)")
    p.add_argument("-n", type=int, default=None, help="only the first N training images (synthetic: how many to draw)")
    p.add_argument("--n-val", type=int, default=None, help="only the first N validation images (mnist-idx has none)")
    p.add_argument("--root", type=Path, default=default_data_root(),
                   help="where the data set is (default: $COURSE_DATA or the repo's data/)")
    args = parser.parse_args(argv)
    if args.command == "shard":
        from .shards import per_shard_for, tar_bytes_per_sample, write_shards
        from .sources import raw_images

        splits = ("train",) if args.name == "mnist-idx" else ("train", "val")
        for split in splits:
            try:
                images, labels = raw_images(args.name, args.root, args.n if split == "train" else args.n_val,
                                            split=split)
                per_shard = args.per_shard or per_shard_for(len(images), tar_bytes_per_sample(images))
                manifest = write_shards(images, labels, args.out / split, per_shard, source=args.name,
                                        progress=_every(30, f"{split}: {{}} of {{}} images written"))
            except (DatasetMissingError, ValueError) as exc:
                print(f"error: {exc}", file=sys.stderr)
                return 1
            size, counts = sum(s["bytes"] for s in manifest["shards"]), [s["samples"] for s in manifest["shards"]]
            why = "" if args.per_shard else (" (chosen for the data set: 64 shards or more where it allows, at least "
                                             "100 samples and at most 256 MiB each; --per-shard sets it)")
            short = f", the last of {counts[-1]}" if counts[-1] != per_shard else ""
            print(f"{split}: {manifest['samples']} images of {args.name} in {len(counts)} shard(s) of {per_shard}{short}, "
                  f"{size / 2**20:.1f} MiB, in {args.out / split}{why}")
        if splits == ("train",):
            print(f"no val/: {args.name} has no validation split. train.py --dataset shards needs one: shard mnist "
                  "or cifar10 (python -m course_utils.data download ... on a login node) to train from shards")
        return 0
    if args.command == "download":
        try:
            if args.name == "tinyshakespeare":  # text for scripts/train_lm.py --text
                from .text import download_text

                path = download_text(args.root)
                print(f"{args.name} is ready: scripts/train_lm.py --text {path}")
                return 0
            root = download(args.name, args.root)
        except Exception as exc:  # offline node, proxy, full quota: say it in one line
            print(f"download of {args.name} into {args.root} failed: {exc}\n"
                  "Run this on a login node with internet access.", file=sys.stderr)
            return 1
        print(f"{args.name} is ready in {root}")
        return 0
    try:
        train, val, _ = get_datasets(args.name, args.root, augment=False)
    except DatasetMissingError as exc:
        print(exc, file=sys.stderr)
        return 1
    print(f"{args.name} in {args.root}: {len(train)} train / {len(val)} test images")
    return 0


if __name__ == "__main__":
    sys.exit(main())
