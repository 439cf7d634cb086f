"""Notebook 10: a DataLoader for a rank whose cores run out."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

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


def check_rank_loader(make: Callable[..., tuple[Any, float]], dataset: Any, batch_size: int,
                      measured: Sequence[Mapping[str, Any]], steps: int = 20) -> None:
    """``make(dataset, batch_size, worker_ms, compute_ms, cores, handover_ms)`` -> (a shuffling DataLoader of
    ``dataset`` in batches of ``batch_size`` with the workers a rank of ``cores`` cores should ask for, the
    accelerator utilisation it gives in steady state), when one worker prepares a batch in ``worker_ms``, a step
    computes for ``compute_ms`` and taking a ready batch costs ``handover_ms``. Judged first on this machine: for each
    row of ``measured`` (``worker_ms``, ``compute_ms``, ``cores``, ``handover_ms``), the loader is run by the DLIO
    method and its utilisation measured; then, exactly and without running them, on ranks not measured here."""
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset

    from ..data.formats import emulate_training

    def built(data: Any, batch: int, w: float, c: float, cores: int, h: float) -> tuple[Any, float, str]:
        with warnings.catch_warnings():  # a rank of another node may have more cores than this machine
            warnings.filterwarnings("ignore", message="This DataLoader will create")
            loader, au = make(data, batch, w, c, cores, h)
        where = f"{w:.2f} ms per batch per worker, {c:.2f} ms of compute, a {h:.2f} ms hand-over, {cores} cores"
        if not isinstance(loader, DataLoader):
            raise WrongAnswer(f"{where}: return (a torch.utils.data.DataLoader, a utilisation), not {type(loader).__name__}")
        if loader.dataset is not data or loader.batch_size != batch:
            raise WrongAnswer(f"{where}: the loader must read the data set it was given, in batches of {batch}")
        if not isinstance(loader.sampler, RandomSampler):
            raise WrongAnswer(f"{where}: a training loader shuffles (shuffle=True): this one reads in order")
        want = _plan(w, c, cores, h)[0]
        if loader.num_workers != want:
            raise WrongAnswer(f"{where}: your loader has {loader.num_workers} workers, it takes {want}. "
                              + _workers_hint(loader.num_workers, want, w, c + h, cores))
        return loader, au, where

    for row in measured:
        w, c, cores, h = row["worker_ms"], row["compute_ms"], int(row["cores"]), row["handover_ms"]
        loader, au, where = built(dataset, batch_size, w, c, cores, h)
        seen = emulate_training(loader, c / 1000, steps=steps)["au"]  # your loader, run as section 2 ran its own
        if not (math.isfinite(au) and abs(au - seen) <= AU_SLACK):  # a burst of other work stalls a short run: again
            seen = emulate_training(loader, c / 1000, steps=steps)["au"]
        if not (math.isfinite(au) and abs(au - seen) <= AU_SLACK):
            if abs(au - _plan(w, c, cores, h)[1]) <= 1e-6:
                raise WrongAnswer(f"your model is the course's, but your loader with {loader.num_workers} workers and "
                                  f"{c:.2f} ms of compute measured a utilisation of {seen:.2f} here, not {au:.2f}: "
                                  "something else used the cores (look at the machine's load), or the model misses "
                                  "a cost here; run section 2 again")
            raise WrongAnswer(f"{where}: you predict a utilisation of {au:.2f}, your loader measured {seen:.2f}. How "
                              "often can the training process take a batch, and how often do the workers deliver one?")
    small = TensorDataset(torch.zeros(64, 1))
    for (w, c, cores, h), (_, want_au) in PLAN_CASES.items():
        loader, au, where = built(small, 8, w, c, cores, h)
        if not (math.isfinite(au) and abs(au - want_au) <= 1e-6):
            raise WrongAnswer(f"right for this machine, but {where}, {loader.num_workers} workers: you predict a "
                              f"utilisation of {au:.3f}, it is {want_au:.3f} ({loader.num_workers} workers deliver a "
                              f"batch every {w / loader.num_workers:g} ms; the training process takes one every "
                              f"{c + h:g} ms at best, and computes in {c:g} of them)")
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

