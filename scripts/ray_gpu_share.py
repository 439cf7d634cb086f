#!/usr/bin/env python
"""How Ray shares a GPU among tasks that each ask for a fraction of one (notebook 08, section 2). Each task asks
for --gpus-per-task GPUs, sleeps as a trial would train, and reports which GPU Ray gave it (ray.get_gpu_ids(),
and the CUDA_VISIBLE_DEVICES Ray set for it) and when it ran. Ray counts GPUs as numbers, not memory: two tasks
of 0.5 run on one GPU at the same time, a third waits for one of them to finish, and nothing stops the two from
using more than half of its memory each.

    python scripts/ray_gpu_share.py                   # on a GPU node: its GPUs
    python scripts/ray_gpu_share.py --logical-gpus 1  # anywhere: Ray counts a GPU that the machine need not have
"""

import argparse
import os
import time

import ray

parser = argparse.ArgumentParser()
parser.add_argument("--tasks", type=int, default=3)
parser.add_argument("--gpus-per-task", type=float, default=0.5)
parser.add_argument("--logical-gpus", type=int, default=None,
                    help="the GPUs Ray counts, whatever the machine has (default: the GPUs it finds)")
parser.add_argument("--seconds", type=float, default=2.0, help="how long each task holds its share")
args = parser.parse_args()


@ray.remote
def task(i: int, seconds: float) -> dict:
    start = time.time()
    time.sleep(seconds)  # stands for a trial's training
    return {"task": i, "gpu_ids": ray.get_gpu_ids(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "start": start, "end": time.time()}


# address="local": a Ray of its own, even beside another on this machine; one CPU a task, so only GPUs limit
ray.init(address="local", num_cpus=args.tasks, num_gpus=args.logical_gpus, include_dashboard=False,
         log_to_driver=False, logging_level="WARNING")
gpus = ray.cluster_resources().get("GPU", 0)
if args.gpus_per_task > gpus:
    raise SystemExit(f"Ray counts {gpus:g} GPUs, fewer than the {args.gpus_per_task:g} a task asks for: "
                     "run on a GPU node, or give --logical-gpus 1")
print(f"Ray counts {gpus:g} GPU(s); {args.tasks} tasks ask for {args.gpus_per_task:g} GPU each")
t0 = time.time()
rows = ray.get([task.options(num_gpus=args.gpus_per_task).remote(i, args.seconds) for i in range(args.tasks)])
for r in sorted(rows, key=lambda r: r["start"]):
    print(f"task {r['task']}: ray.get_gpu_ids() {r['gpu_ids']}, CUDA_VISIBLE_DEVICES={r['visible']}, "
          f"ran from {r['start'] - t0:4.1f} s to {r['end'] - t0:4.1f} s")
most = max(sum(o["start"] <= r["start"] < o["end"] for o in rows) for r in rows)
print(f"at most {most} tasks at once: {gpus:g} GPU(s) / {args.gpus_per_task:g} a task = "
      f"{int(gpus / args.gpus_per_task)} places")
ray.shutdown()
