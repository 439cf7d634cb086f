#!/usr/bin/env python
"""Each process says who it is: what its launcher put in the environment and
what course_utils.process_group made of it. Run it under any launcher:

    torchrun --standalone --nproc-per-node=2 scripts/whoami.py
    srun --ntasks=4 python scripts/whoami.py
    mpirun -np 2 python scripts/whoami.py
"""

from __future__ import annotations

import os
import sys

import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.results import emit_result

SHOWN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
         "SLURM_PROCID", "SLURM_LOCALID", "SLURM_STEP_NUM_TASKS", "SLURM_STEP_NODELIST",
         "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE")


def main() -> int:
    with cdist.session("cpu") as (info, device):
        env = {k: os.environ[k] for k in SHOWN if k in os.environ}
        backend = dist.get_backend() if cdist.is_initialized() else "none"
        cdist.print_ranks(f"{cdist.describe(info)} backend={backend}\n    env: {env}")
        emit_result({"world_size": cdist.get_world_size(), "launcher": info.launcher})
        return 0


if __name__ == "__main__":
    sys.exit(main())
