#!/usr/bin/env python
"""A collective that one rank never joins: a hang, turned into an error by the timeout.

The last rank skips the all-reduce (as a rank stuck in I/O, or a bug that
makes one rank take another branch, would) and sleeps. The others wait in
the all-reduce for the process group's timeout (``$COURSE_DIST_TIMEOUT``,
600 s by default; set it low here) and then fail:

* gloo raises an error in the waiting ranks;
* NCCL's watchdog notices the timed-out collective and, with
  ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` (PyTorch's default), takes the
  process down rather than leaving it hanging on the GPU.

Either way the launcher (torchrun, srun) sees a failed rank and stops the
rest, so the job ends and frees its nodes instead of burning its time limit.

    COURSE_DIST_TIMEOUT=10 torchrun --standalone --nproc-per-node=2 scripts/collective_timeout.py
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.distributed as dist

from course_utils import process_group as cdist
from course_utils.devices import add_device_flag
from course_utils.errors import first_line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_device_flag(p)
    args = p.parse_args()
    info, device = cdist.init_distributed(args.device)
    cdist.require_processes(2, "collective_timeout.py")
    rank, last = info.rank, info.world_size - 1
    dist.barrier()  # everyone is here; now one rank goes astray
    if rank == last:
        print(f"rank {rank}: skipping the all_reduce and sleeping (a stuck rank)", flush=True)
        time.sleep(3600)  # the launcher ends this process once another rank has failed
        return 0
    x = torch.ones(4, device=device)
    start = time.perf_counter()
    print(f"rank {rank}: all_reduce on {device} ({dist.get_backend()}), waiting for rank {last}...", flush=True)
    try:
        dist.all_reduce(x)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL is asynchronous: the wait happens here
    except Exception as exc:  # gloo: the timeout surfaces as an exception
        print(f"rank {rank}: the all_reduce failed after {time.perf_counter() - start:.1f} s: "
              f"{first_line(exc, with_type=True)}", flush=True)
        return 1
    print(f"rank {rank}: the all_reduce returned, which it must not: rank {last} never joined", flush=True)
    return 2


if __name__ == "__main__":
    sys.exit(main())
