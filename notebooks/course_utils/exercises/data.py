"""Notebook 10: DataLoader workers when a rank's cores run out."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .core import WrongAnswer, passed


# --------------------------------------------------------------------------- #
# 10: DataLoader workers when a rank's cores run out
# --------------------------------------------------------------------------- #
# (worker_ms, compute_ms, cores of the rank, handover_ms) -> (workers, accelerator utilisation): ranks of Frontera's
# rtx nodes (16 cores, 4 GPUs: 4 cores a rank), of FT3 (64 cores, 2 GPUs: 32 a rank), and of smaller shares
PLAN_CASES = {(40.0, 5.0, 4, 0.0): (3, 0.375), (40.0, 5.0, 32, 0.0): (8, 1.0), (40.0, 5.0, 32, 1.0): (7, 5 / 6),
              (12.0, 30.0, 4, 0.5): (1, 30 / 30.5), (30.0, 10.0, 4, 0.0): (3, 1.0), (25.0, 4.0, 8, 0.0): (7, 1.0),
              (25.0, 4.0, 8, 1.0): (5, 0.8), (25.0, 4.0, 6, 0.0): (5, 0.8), (9.0, 2.0, 2, 0.0): (1, 2 / 9),
              (9.0, 2.0, 2, 1.0): (1, 2 / 9)}
AU_SLACK = 0.25  # how far a measured utilisation may sit from the model's: the runs' noise on a loaded 2-core
#                 machine (a worker's time per batch moved by a third between runs there)


def _plan(worker_ms: float, compute_ms: float, cores: int, handover_ms: float) -> tuple[int, float]:
    step = compute_ms + handover_ms  # the training process takes a batch every step at best
    wanted = math.ceil(worker_ms / step)  # k workers deliver k batches every worker_ms
    workers = max(1, min(wanted, cores - 1))  # a core is the training process's
    return workers, compute_ms / max(step, worker_ms / workers)


def check_plan_workers(plan: Callable[[float, float, int, float], tuple[int, float]],
                       measured: Sequence[Mapping[str, Any]]) -> None:
    """``plan(worker_ms, compute_ms, cores, handover_ms)`` -> (DataLoader workers to ask for on a rank with
    ``cores`` cores, the accelerator utilisation they give in steady state), when one worker prepares a batch in
    ``worker_ms``, a step computes for ``compute_ms`` and taking a ready batch costs ``handover_ms``. Judged first
    against this run: each row of ``measured`` holds ``worker_ms``, ``compute_ms``, ``cores`` (this machine's),
    ``handover_ms`` and ``au``, the utilisation the DLIO method measured by number of workers; then exactly,
    against ranks not measured here."""
    for row in measured:
        w, c, cores, h = row["worker_ms"], row["compute_ms"], int(row["cores"]), row["handover_ms"]
        workers, au = plan(w, c, cores, h)
        want_workers, want_au = _plan(w, c, cores, h)
        if workers != want_workers:
            raise WrongAnswer(f"{w:.2f} ms per batch per worker, {c:.2f} ms of compute, a {h:.2f} ms hand-over, {cores} "
                              f"cores: you ask for {workers} workers, it takes {want_workers}. "
                              + _workers_hint(workers, want_workers, w, c + h, cores))
        seen = row["au"].get(workers)
        if seen is not None and not (math.isfinite(au) and abs(au - seen) <= AU_SLACK):
            if abs(au - want_au) <= 1e-6:
                raise WrongAnswer(f"your model is the course's, but with {workers} workers and {c:.2f} ms of compute "
                                  f"this run measured a utilisation of {seen:.2f}, not {au:.2f}: something else used "
                                  "the cores during section 2 (look at the machine's load), or the model misses a "
                                  "cost here; run section 2 again")
            raise WrongAnswer(f"{workers} workers of {w:.2f} ms a batch, {c:.2f} ms of compute and a {h:.2f} ms "
                              f"hand-over: you predict a utilisation of {au:.2f}, this run measured {seen:.2f}. How "
                              "often can the training process take a batch, and how often do the workers deliver one?")
    for (w, c, cores, h), (want_workers, want_au) in PLAN_CASES.items():
        workers, au = plan(w, c, cores, h)
        where = f"right for this machine, but a rank of {cores} cores, {w:g} ms per batch per worker, {c:g} ms of " \
                f"compute and a {h:g} ms hand-over"
        if workers != want_workers:
            raise WrongAnswer(f"{where}: you ask for {workers} workers, it takes {want_workers}. "
                              + _workers_hint(workers, want_workers, w, c + h, cores))
        if not (math.isfinite(au) and abs(au - want_au) <= 1e-6):
            raise WrongAnswer(f"{where}, {workers} workers: you predict a utilisation of {au:.3f}, it is {want_au:.3f} "
                              f"({workers} workers deliver a batch every {w / workers:g} ms; the training process "
                              f"takes one every {c + h:g} ms at best, and computes in {c:g} of them)")
    passed("ceil(worker_ms / (compute_ms + handover_ms)) workers where the cores allow, else one per core but the "
           "training process's; the device computes compute_ms out of every max(compute_ms + handover_ms, "
           "worker_ms / workers)")


def _workers_hint(got: Any, want: int, w: float, c: float, cores: int) -> str:
    if not isinstance(got, int) or isinstance(got, bool):
        return "a number of processes is a whole number (an int)"
    if got > cores - 1 and got > 1:
        return (f"the rank has {cores} cores and its training process needs one: more workers than "
                f"{max(1, cores - 1)} share cores and are each slower, they do not deliver more")
    if got < 1:
        return ("with 0 workers the training process reads each batch between steps and the device waits for "
                "every one: at least 1")
    if got < want:
        return (f"{got} workers deliver a batch every {w / got:.2f} ms; the training process takes one every "
                f"{c:.2f} ms, and the rank has cores for {want}")
    return (f"{want} already deliver a batch as often as the training process can take one; each further worker "
            "costs a core and memory")

