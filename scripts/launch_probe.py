#!/usr/bin/env python
"""What a job script gives each process, in a second and without a GPU hour: run it as the TRAIN_SCRIPT of any
slurm/ pattern before the real training (a new centre's site file, a changed #SBATCH line).

    TRAIN_SCRIPT=scripts/launch_probe.py sbatch slurm/ft3/multi_node_srun.sbatch

Each process prints one line: its rank and world as torchrun or slurm/lib/torch_env.sh set them, its host, the GPUs
it sees, the CPUs it may use and its threads, its flags (a sweep's trial adds its own); and it writes a file into
the RUN_DIR the pattern hands it, as a researcher's script saving there would (without creating it). It imports neither torch nor
course_utils, so a probe of 8 ranks costs a few seconds; it joins no group (scripts/plain_ddp.py does: run it next).
(The Ray pattern needs no probe: its job script waits for every node to join Ray and says so in the log.)
"""

from __future__ import annotations

import json
import os
import socket
import sys

PREFIX = "PROBE "


def process() -> dict:
    env = os.environ
    visible = env.get("CUDA_VISIBLE_DEVICES")  # unset: the process sees every GPU of the node
    # without a launcher's variables a process is rank 0 of 1, as a plain `python train.py` is to the course
    return {"host": socket.gethostname().split(".")[0], "rank": int(env.get("RANK", 0)),
            "local_rank": int(env.get("LOCAL_RANK", 0)), "world_size": int(env.get("WORLD_SIZE", 1)),
            "local_world_size": int(env.get("LOCAL_WORLD_SIZE", 1)),
            "rendezvous": f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}",
            "gpus": None if visible is None else [g for g in visible.split(",") if g],
            "cpus": len(os.sched_getaffinity(0)),
            "threads": env.get("OMP_NUM_THREADS", ""), "args": sys.argv[1:]}


def write_into_run_dir(seen: dict) -> str | None:
    """This process's report as a file in $RUN_DIR (the folder is the job script's to create, not ours); the
    file's path, None without a RUN_DIR, or raises OSError as a script saving there would."""
    run_dir = os.environ.get("RUN_DIR")
    if not run_dir:
        return None
    path = os.path.join(run_dir, f"probe-{seen['host']}-rank{seen['rank']}.json")
    with open(path, "w") as f:
        json.dump(seen, f)
    return path


def main() -> int:
    seen = process()
    try:
        seen["wrote"] = write_into_run_dir(seen)
    except OSError as exc:
        print(f"error: could not write into RUN_DIR={os.environ['RUN_DIR']}: {exc}", file=sys.stderr, flush=True)
        return 1
    shown = "every GPU of the node (CUDA_VISIBLE_DEVICES unset)" if seen["gpus"] is None else None
    gpus = shown or f"GPUs {','.join(seen['gpus']) or 'none'}"
    line = (f"rank {seen['rank']} of {seen['world_size']} (local {seen['local_rank']} of {seen['local_world_size']}) "
            f"on {seen['host']}: {gpus}, {seen['cpus']} CPUs, OMP_NUM_THREADS={seen['threads'] or 'unset'}, "
            f"rendezvous {seen['rendezvous']}")
    # one write: the ranks of a node share torchrun's pipe, and an unbuffered print is two writes (text, then the
    # newline) that another rank's line can come between; one write under PIPE_BUF (4 KiB) arrives whole
    os.write(sys.stdout.fileno(), f"{line}\n{PREFIX}{json.dumps(seen)}\n".encode())
    return 0


if __name__ == "__main__":
    sys.exit(main())
