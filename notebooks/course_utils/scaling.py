"""Scaling runs: the same ``scripts/train.py`` under torchrun with 1, 2, ... ranks.

Weak scaling keeps the batch *per rank* fixed, so N ranks do N times the work
per step; perfect scaling keeps images/s per rank constant, and
``efficiency(N) = per-rank images/s at N / per-rank images/s at 1``.
On CPUs every rank gets the same number of threads in every run
(``threads_per_rank``); otherwise one rank would get the whole machine and
the comparison would measure threads, not communication.
"""

from __future__ import annotations

from collections.abc import Sequence

from . import hardware
from .config import TrainConfig, config_flags
from .launch import run_script
from .results import parse_result


def measure_scaling(
    world_sizes: Sequence[int],
    train_args: Sequence[str],
    threads_per_rank: int | None = None,
    timeout_s: float = 900,
    echo: bool = False,
) -> list[dict]:
    """Run train.py once per world size; one row per run with throughput and efficiency."""
    rows: list[dict] = []
    for n in world_sizes:
        env = {"OMP_NUM_THREADS": str(threads_per_rank)} if threads_per_rank else {}
        run = run_script("train.py", [*map(str, train_args), "--no-progress"], nproc=n if n > 1 else None,
                         timeout_s=timeout_s, echo=echo, env=env)
        result = parse_result(run.output)
        rows.append({"world_size": n, "per_rank": result["images_per_s_per_rank"],
                     "total": result["images_per_s_per_rank"] * n, "seconds": run.seconds,
                     "device": result["device"]})
    base = rows[0]["per_rank"] if rows else float("nan")
    for row in rows:
        row["efficiency"] = row["per_rank"] / base
    return rows


OPTIMISED = ("AMP (bf16, or fp16 where the GPU has no bf16), channels_last, DataLoader workers, "
             "TF32 as PyTorch's default")
"""The single-device setup notebook 01 ends with; scaling is measured on it, not on the textbook loop."""


def optimised_args(on_gpu: bool, ranks_per_host: int) -> list[str]:
    """``train.py`` flags for :data:`OPTIMISED`: workers from the cores each rank may use.

    On a CPU the workers would take cores from the ranks' own compute
    (notebook 01 measured it), so CPU runs load data in the main process.
    """
    workers = min(8, max(1, hardware.threads_per_rank(ranks_per_host) - 1)) if on_gpu else 0
    return config_flags(TrainConfig(precision="amp", channels_last=True, workers=workers))


def optimised_label(on_gpu: bool) -> str:
    """What :func:`optimised_args` runs as here: on a CPU, AMP resolves to what the CPU computes fast, and no
    DataLoader workers."""
    if on_gpu:
        return OPTIMISED
    from .precision import cpu_bf16_here, precision_for

    amp = precision_for("amp", "cpu", cpu_bf16=cpu_bf16_here())
    return (f"{amp} (what --precision amp resolves to on this CPU), channels_last, data loaded in the main process "
            "(DataLoader workers would take the ranks' cores)")


def scaling_table(rows: list[dict]) -> str:
    out = [f"{'ranks':>5s} {'img/s per rank':>15s} {'img/s total':>12s} {'efficiency':>10s}"]
    for r in rows:
        out.append(f"{r['world_size']:5d} {r['per_rank']:15,.0f} {r['total']:12,.0f} {100 * r['efficiency']:9.0f}%")
    return "\n".join(out)
