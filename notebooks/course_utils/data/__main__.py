"""Command line: ``python -m course_utils.data download cifar10 --root DIR`` (on a login node)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .sources import DatasetMissingError, default_data_root, download, get_datasets


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.data",
        description="Fetch the course's data sets (on a login node) or check they are in place.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for cmd, help_ in (("download", "download a data set"), ("check", "check it is on disk")):
        p = sub.add_parser(cmd, help=help_)
        p.add_argument("name", choices=("cifar10", "mnist"))
        p.add_argument("--root", type=Path, default=default_data_root(),
                       help="target folder (default: $COURSE_DATA or the repo's data/)")
    args = parser.parse_args(argv)
    if args.command == "download":
        try:
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
