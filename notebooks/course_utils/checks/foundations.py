"""Notebooks 01-03: the course's program, the launchers and collectives of 02, train.py under torchrun, the take-home
scripts on one node."""

from __future__ import annotations

from pathlib import Path

from ..claims import verify
from ..launch import RunResult
from ..results import plain_epochs, plain_steps, plain_summary


def check_script_run(result: dict, run_dir: Path, epochs: int) -> None:
    """01: the ladder's best configuration run as scripts/train.py, its checkpoint and logs in ``run_dir``."""
    losses = result["train_loss"]
    verify([
        (f"the program ran the configuration it was given: one process, {epochs} epochs",
         result["world_size"] == 1 and result["epochs"] == epochs),
        (f"and it learns: {losses[0]:.3f} -> {losses[-1]:.3f}", losses[-1] < losses[0]),
        ("its checkpoint and its TensorBoard log are where the flags said",
         (run_dir / "ckpt" / "last.pt").exists() and bool(list((run_dir / "tb").glob("events.out.tfevents.*")))),
    ])


def check_launcher_env(srun: "object") -> None:
    """02: what detect_env makes of the variables srun gives task 3 of a 4-task, 2-node job (job id 81234)."""
    verify([
        (f"srun's task 3 is rank {srun.rank} of {srun.world_size}, local rank {srun.local_rank}, rank 0 on "
         f"{srun.master_addr} (the node list's first)",
         (srun.rank, srun.local_rank, srun.world_size, srun.master_addr) == (3, 1, 4, "gpu-a01")),
        (f"without MASTER_PORT the port comes from the job id: {srun.master_port}",
         srun.master_port == 20000 + 81234 % 20000),
    ])


def check_placements(answers: dict) -> None:
    """02: place_ranks' answers for the three layouts of the cell, by --device."""
    verify([
        ("2 FT3 nodes under srun --gpus-per-task=1: each task's only GPU is its cuda:0",
         answers["2 FT3 nodes, srun --gpus-per-task=1", "cuda"] == ["cuda:0"] * 4),
        ("a 1-GPU portal session: four NCCL ranks cannot share its GPU, --device cuda is refused",
         answers["1-GPU portal session, 4 ranks", "cuda"] == "error"),
        ("and --device auto falls back to gloo on the CPU", answers["1-GPU portal session, 4 ranks", "auto"] == ["cpu"] * 4),
    ])


def check_bandwidth(bench: dict) -> None:
    """02: allreduce_bench.py's JSON: the hand-written ring against all_reduce, and bandwidth over message sizes
    (algorithm bandwidth, as the script's table prints it: beside the chart's bus bandwidth it would give away the
    exercise's factor)."""
    builtin = sorted((r["bytes"], r["algbw"]) for r in bench["rows"] if r["impl"] == "builtin")
    small, large = builtin[0][1], builtin[-1][1]
    verify([
        (f"the ring computes what all_reduce computes (int64 identical, float64 within {bench['ring_max_rel_diff']:.0e})",
         bench["ring_int_exact"] and bench["ring_max_rel_diff"] < 1e-12),
        (f"small messages are latency-bound, large ones bandwidth-bound: {small:.4f} GB/s of algorithm bandwidth "
         f"(the table's) at the smallest, {large:.3f} GB/s at the largest", large > 10 * small),
    ])


def check_param_servers(ps: dict) -> None:
    """02: param_server.py's three schemes, one worker a 3x straggler."""
    sync, asyn = ps["sync-ps"], ps["async-ps"]
    verify([
        (f"the asynchronous server does not wait for the straggler: the same {asyn['gradients']} gradients at "
         f"{asyn['grads_per_s']:.0f}/s against the synchronous server's {sync['grads_per_s']:.0f}/s",
         asyn["grads_per_s"] > sync["grads_per_s"]),
        (f"so the fast workers contribute more: {asyn['gradients_per_worker']} (the last is the straggler)",
         asyn["gradients_per_worker"][-1] < max(asyn["gradients_per_worker"])),
        (f"and it pays with gradients computed on old parameters: a mean staleness of {asyn['mean_staleness']:.1f}",
         asyn["mean_staleness"] > 0),
        (f"the server is the bottleneck: {sync['busiest_rank_mib_per_round']:.1f} MiB a round through its busiest rank, "
         f"{ps['allreduce']['busiest_rank_mib_per_round']:.1f} for the all-reduce",
         sync["busiest_rank_mib_per_round"] > ps["allreduce"]["busiest_rank_mib_per_round"]),
    ])


def check_ddp_run(run: RunResult, result: dict, run_dir: Path, ranks: int) -> None:
    """train.py under torchrun on ``ranks`` ranks, its checkpoints in ``run_dir/ckpt``, its TensorBoard files in
    ``run_dir/tb``."""
    losses = result["train_loss"]
    saved = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    verify([
        (f"train.py found torchrun's {ranks} ranks", result["world_size"] == ranks
         and f"launcher=torchrun rank=0/{ranks}" in run.output),
        (f"the loss fell under DDP: {losses[0]:.3f} -> {losses[-1]:.3f}", losses[-1] < losses[0]),
        ("every rank ended with the same weights: DDP averaged the same gradients everywhere", result["ranks_agree"]),
        ("only rank 0 reported", sum(line.startswith("RESULT") for line in run.lines) == 1),
        (f"only rank 0 wrote checkpoints: {', '.join(saved)}", saved in (["last.pt"], ["last.prev.pt", "last.pt"])),
        ("only rank 0 wrote TensorBoard events: one file",
         len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 1),
    ], detail=run.output[-2000:])


def check_plain_ddp(single: RunResult, ddp: RunResult, ranks: int) -> None:
    """plain_single.py on one device and plain_ddp.py on ``ranks`` ranks, from the same data."""
    one, many, done = plain_epochs(single.output), plain_epochs(ddp.output), plain_summary(ddp.output)
    verify([
        (f"one device trained: the loss fell from {one[0]:.3f} to {one[-1]:.3f}", one[-1] < one[0]),
        (f"{ranks} ranks trained: the loss fell from {many[0]:.3f} to {many[-1]:.3f}", many[-1] < many[0]),
        (f"each rank took 1/{ranks} of an epoch's batches ({plain_steps(ddp.output)[0]} steps, not "
         f"{plain_steps(single.output)[0]}): the sampler split the data",
         plain_steps(ddp.output)[0] == plain_steps(single.output)[0] // ranks),
        ("only rank 0 printed: one line per epoch", len(many) == len(one)),
        (f"all {ranks} ranks ended with identical weights", done["world_size"] == ranks and done["identical"]),
    ], detail=ddp.output[-2000:])


def check_n_by_b(checks: dict, steps: int) -> None:
    """scripts/ddp_checks.py's RESULT: N ranks x B against 1 process x N*B, from the same seed and images."""
    verify([
        ("each rank's local gradients differed, and were bit-identical on every rank after DDP's all-reduce",
         checks["local_grads_differed"] and checks["grads_identical"]),
        (f"after {steps} steps, N x B and 1 x N*B agree within the float64 tolerance derived from the sums "
         f"({checks['max_abs_diff']:.1e} <= {checks['float64_atol']:.1e})",
         checks["within_tolerance"] and checks["ranks_identical"] and checks["steps"] == steps),
        (f"training moved the weights far more than that ({checks['max_moved']:.2g}, over 100 times as much)",
         checks["max_moved"] > 100 * checks["max_abs_diff"]),
        (f"a DDP that sums the gradients instead misses by {checks['summed_max_abs_diff']:.2g}, over a million "
         "times the tolerance", checks["summed_max_abs_diff"] > 1e6 * checks["float64_atol"]),
    ])


def check_buckets(rows: list[dict]) -> None:
    """scripts/ddp_buckets.py's rows: all-reduce calls per step by bucket size, and with accumulation."""
    by_cap = {r["bucket_cap_mb"]: r["allreduces_per_step"] for r in rows if r["accum"] == 1 and not r["grad_as_bucket_view"]}
    accum = {r["no_sync"]: r["allreduces_per_step"] for r in rows if r["accum"] == 4}
    verify([
        (f"smaller buckets, more all-reduces a step: {by_cap[1.0]:g} at 1 MB, {by_cap[25.0]:g} at 25 MB, "
         f"{by_cap[100.0]:g} at 100 MB", by_cap[1.0] > by_cap[25.0] > by_cap[100.0] >= 1),
        (f"4 micro-batches: {accum[True]:g} all-reduce(s) with no_sync, {accum[False]:g} without, 4 times as many",
         accum[False] == 4 * accum[True]),
    ])
