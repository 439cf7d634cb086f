"""Reference solutions of the notebooks' exercises.

The test suite runs them through the same checkers as a learner's answer
(``COURSE_SOLUTIONS=1``). Try the exercise before you read on.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence


def half_speed_size(files_per_s: float, file_bytes: int, big_mib_per_s: float) -> float:
    bandwidth = big_mib_per_s * 2**20  # bytes/s once a file is open
    per_file = 1 / files_per_s - file_bytes / bandwidth  # what a file costs beyond its bytes: open, metadata, close
    # a file of size s takes per_file + s / bandwidth: half speed where both terms are equal
    return max(0.0, per_file) * bandwidth


def accumulation(global_batch: int, fits: int) -> tuple[int, int]:
    accum = next(a for a in range(1, global_batch + 1) if global_batch % a == 0 and global_batch // a <= fits)
    return global_batch // accum, accum


def accumulation_is_exact(model) -> bool:
    from torch import nn

    # BatchNorm normalises with the statistics of the batch it sees: 4 micro-batches of 32 are not one of 128
    return not any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def ring_bytes(nbytes: int, world: int) -> float:
    # reduce-scatter and all-gather: N-1 steps each, one chunk of S/N per step
    return 2 * (world - 1) * nbytes / world


def strong_step(one_rank_s: float, weak: Mapping[int, float], n: int) -> float:
    # each rank computes 1/n of the global batch; the all-reduce is the gradient's, whatever the batch: weak
    # scaling measured its cost at n ranks as the extra time over one rank
    return one_rank_s / n + (weak[n] - weak[1])


def best_interval(write_s: float, mtbf_s: float) -> float:
    # per second of training: write_s / every spent writing, and a failure (1 / mtbf_s per second) loses
    # every / 2 on average; d/d(every) of write_s / every + every / (2 * mtbf_s) is zero at (Young, 1974):
    return math.sqrt(2 * write_s * mtbf_s)


def repaired_sbatch(attempt: str) -> str:
    repaired = attempt.replace("--ntasks-per-node=1 ", "--ntasks-per-node=4 ")  # one rank per GPU
    repaired = repaired.replace("--cpus-per-task=16 ", "--cpus-per-task=4 ")     # 16 cores shared by 4 ranks
    # srun no longer passes --cpus-per-task on (Slurm >= 22.05); and srun's tasks see only what is exported
    exports = "export SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK MASTER_ADDR MASTER_PORT"
    return repaired.replace("\nsrun ", f"\n{exports}\nsrun ", 1)


def fabric_epoch(fabric, model, optimizer, loader, accumulate: int) -> int:
    import torch

    steps = 0
    for i, (x, y) in enumerate(loader):
        last = (i + 1) % accumulate == 0 or i + 1 == len(loader)  # the last group may be shorter: it steps too
        with fabric.no_backward_sync(model, enabled=not last):  # no all-reduce until a step uses the gradients
            fabric.backward(torch.nn.functional.cross_entropy(model(x), y) / accumulate)
        if last:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps


def ds_config_for(psi: int, ranks: int, gpu_bytes: float, precision: str) -> dict | None:
    # bytes per parameter as DeepSpeed held them: weights, gradients, and 12 of optimizer state (its fp32 copy and
    # Adam's two moments) in bf16 and in fp32 alike (section 4's fp32 row: the optimizer part did not shrink)
    whole = {"params": 2, "gradients": 2, "optimizer": 12} if precision != "fp32" else \
        {"params": 4, "gradients": 4, "optimizer": 12}
    sharded_parts = {0: (), 1: ("optimizer",), 2: ("optimizer", "gradients"), 3: ("optimizer", "gradients", "params")}
    for stage, sharded in sharded_parts.items():
        held = sum(b * psi / (ranks if part in sharded else 1) for part, b in whole.items())
        if held <= gpu_bytes:
            config = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage}}
            if precision != "fp32":
                config["bf16"] = {"enabled": True}
            return config
    return None


def trials_at_once(nodes: int, node_cpus: float, node_gpus: float, trial_cpus: float, trial_gpus: float) -> int:
    per_node = node_cpus // trial_cpus  # what the CPUs allow
    if trial_gpus:
        per_gpu = 1 // trial_gpus if trial_gpus < 1 else 1  # a fraction stays on one GPU
        per_node = min(per_node, node_gpus // max(trial_gpus, 1) * per_gpu)
    return int(nodes * per_node)


def interleaved_bubble(stages: int, microbatches: int, chunks: int) -> float:
    # a slot is a micro-batch through one chunk (1/v of a rank's time for it): a rank works in v*m slots,
    # and the pipeline fills and drains in p-1 of them
    return (stages - 1) / (chunks * microbatches + stages - 1)


def scaled_lr_space() -> dict:
    from ray import tune

    # the base rate log-uniform (each decade alike), the batch a choice; lr resolved from both for each trial. The
    # base is the search's own value, which the trial does not read: its name starts with an underscore
    return {"_base_lr": tune.loguniform(1e-3, 1e-1), "batch_size": tune.choice([32, 64, 128]),
            "lr": tune.sample_from(lambda config: config["_base_lr"] * config["batch_size"] / 32)}


def swiglu_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    # silu(gate(x)) * up(x) is elementwise: each rank multiplies its own columns of gate and up, the same hidden
    # units, so both split by output features; down takes those units as its input rows: row parallel, one all-reduce
    return {"gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()}


def rank_loader(dataset, batch_size: int, worker_ms: float, compute_ms: float, cores: int,
                handover_ms: float) -> tuple:
    from torch.utils.data import DataLoader

    # the training process takes a batch at best every compute_ms + handover_ms; k workers deliver k batches every
    # worker_ms, so ceil(worker_ms / (compute_ms + handover_ms)) keep up, but the rank has cores - 1 for workers
    # (one runs the training process), and at least one
    step = compute_ms + handover_ms
    workers = max(1, min(math.ceil(worker_ms / step), cores - 1))
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers)
    # the device computes compute_ms out of every max(step, worker_ms / workers)
    return loader, compute_ms / max(step, worker_ms / workers)


def behind(records: dict) -> tuple[int, int, str]:
    # a sequence number names the same collective on every rank; the rank whose collectives stop earliest is
    # behind, whatever the buffer kept, and the next number is the collective it never entered: its name is in the
    # others'. NCCL's records say what each GPU started; a CPU may have issued more (gloo marks all scheduled)
    nccl = any(e.get("state") in ("started", "completed") for entries in records.values() for e in entries)

    def reached(entries: list) -> int:
        ran = [e["seq"] for e in entries if not nccl or e.get("state") in ("started", "completed")]
        return max(ran, default=0)

    last = {rank: reached(entries) for rank, entries in records.items()}
    rank = min(last, key=last.get)
    seq = last[rank] + 1
    op = next(e["op"] for entries in records.values() for e in entries if e["seq"] == seq)
    return rank, seq, op


def no_drop_capacity(load: list[int], tokens: int, experts: int, top_k: int) -> float:
    # an expert's capacity is the factor times its even share of the assignments (tokens x top_k / experts); the
    # busiest expert must fit, so the factor is its load over that share
    return max(load) / (tokens * top_k / experts)
