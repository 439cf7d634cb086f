#!/usr/bin/env python
"""Which build of the pinned torch a cluster's GPU driver can run: PyPI's, or PyTorch's own CUDA 12 one.

    python envs/cuda_build.py                  # reads the driver from nvidia-smi, where there is one
    python envs/cuda_build.py --driver 550.54  # or from the compute nodes' nvidia-smi, read there

Prints the pip arguments that choose the build (nothing for PyPI's) on stdout, and the choice in one
line on stderr. PyPI's torch wheels of the pinned version are built for CUDA 13.0, which needs a driver
of the 580 series or newer; PyTorch's own index has the same version built for CUDA 12 (cu126 unless
COURSE_TORCH_INDEX names another), which runs on any driver from 525.60 (CUDA's minor-version compatibility). Older drivers cannot run either: the line
says so and the exit status is 2. envs/setup_conda.sh calls this before installing torch.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys

CUDA13_DRIVER = (580, 0)  # CUDA 13.0's minimum Linux driver
CUDA12_DRIVER = (525, 60)  # CUDA 12.x's minimum under minor-version compatibility
CUDA12_INDEX = "https://download.pytorch.org/whl/cu126"  # COURSE_TORCH_INDEX overrides it (another of PyTorch's indexes)


def parse(version: str) -> tuple[int, int]:
    parts = version.strip().split(".")
    return int(parts[0]), int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0


def choose(driver: str | None) -> tuple[list[str], str, int]:
    """(pip arguments, the line that says why, exit status) for a driver version, or None where none was read."""
    if driver is None:
        return [], ("no NVIDIA driver seen here (a login node without GPUs?): installing PyPI's CUDA 13 build, which "
                    "needs driver 580 or newer on the compute nodes; if theirs is older, rerun with "
                    "COURSE_CUDA_DRIVER=<their nvidia-smi driver version>"), 0
    found = parse(driver)
    if found >= CUDA13_DRIVER:
        return [], f"driver {driver}: PyPI's CUDA 13 build of torch", 0
    if found >= CUDA12_DRIVER:
        # an extra index: the same version with a local label (+cu126) sorts above PyPI's, and torch's own
        # dependencies still come from PyPI at constraints.txt's versions
        index = os.environ.get("COURSE_TORCH_INDEX", CUDA12_INDEX)
        return (["--extra-index-url", index],
                f"driver {driver} is older than 580 (CUDA 13): torch's CUDA 12 build from {index}", 0)
    return [], (f"error: driver {driver} is older than 525.60, which every CUDA 12 and 13 build of this torch needs: "
                "ask the centre which newer driver or module to use"), 2


def driver_here() -> str | None:
    """The driver version nvidia-smi reports on this machine, or None without one."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                         text=True)
    lines = [line.strip() for line in out.stdout.splitlines() if line.strip()]
    return lines[0] if out.returncode == 0 and lines else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--driver", help="the compute nodes' driver version (default: this machine's nvidia-smi)")
    args = parser.parse_args(argv)
    pip_args, why, status = choose(args.driver or driver_here())
    print(why, file=sys.stderr)
    print(" ".join(pip_args))
    return status


if __name__ == "__main__":
    raise SystemExit(main())
