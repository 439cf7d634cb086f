"""Notebooks 00-03: a file's fixed cost, gradient accumulation, a ring's bytes, strong scaling."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .core import WrongAnswer, _close, passed


# --------------------------------------------------------------------------- #
# 01: gradient accumulation
# --------------------------------------------------------------------------- #
def check_accumulation(plan: Callable[[int, int], tuple[int, int]], steps: Mapping[str, int] | None = None) -> None:
    """``plan(global_batch, fits)`` -> ``(micro_batch, grad_accum)``: the global batch kept,
    no micro-batch larger than what fits, as few micro-steps as that allows. ``steps``: the
    optimiser steps the notebook measured for the big batch and for the plan (equal if right)."""
    for global_batch, fits in ((128, 32), (256, 256), (96, 40), (512, 48)):
        micro, accum = plan(global_batch, fits)
        if micro * accum != global_batch:
            raise WrongAnswer(f"for a global batch of {global_batch}, {micro} x {accum} = {micro * accum} images "
                              "reach one optimiser step: the learning rate was tuned for the global batch")
        if micro > fits:
            raise WrongAnswer(f"a micro-batch of {micro} does not fit where at most {fits} do (out of memory)")
        fewest = min(a for a in range(1, global_batch + 1) if global_batch % a == 0 and global_batch // a <= fits)
        if accum != fewest:
            raise WrongAnswer(f"{accum} micro-steps for {global_batch} with {fits} fitting: {fewest} would do, and "
                              "each extra one is a forward and backward pass on a smaller, less efficient batch")
    if steps is not None and steps["big batch"] != steps["accumulated"]:
        raise WrongAnswer(f"the runs took {steps['big batch']} and {steps['accumulated']} optimiser steps: "
                          "the same global batch must give the same number of updates")
    passed("the global batch is kept, every micro-batch fits, and the optimiser took the same number of steps")


def accumulation_gap(model: Any, global_batch: int = 8, micro_batch: int = 2, image: tuple = (3, 32, 32)) -> float:
    """One step's gradient from a batch of ``global_batch`` against the same images as micro-batches whose
    gradients are added (each loss scaled by its share): the largest difference, relative to the largest
    gradient, on the CPU, in float64 so that rounding stays far below what a model can make of it."""
    import copy

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, y = torch.randn(global_batch, *image, dtype=torch.float64), torch.randint(0, 10, (global_batch,))
    whole, parts = copy.deepcopy(model).double().cpu().train(), copy.deepcopy(model).double().cpu().train()
    F.cross_entropy(whole(x), y).backward()
    for xs, ys in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(parts(xs), ys) * len(xs) / global_batch).backward()
    a = torch.cat([p.grad.flatten() for p in whole.parameters()])
    b = torch.cat([p.grad.flatten() for p in parts.parameters()])
    return ((a - b).abs().max() / a.abs().max()).item()


def check_accumulation_exact(is_exact: Callable[[Any], bool], models: Mapping[str, Any],
                             image: tuple = (3, 32, 32)) -> dict[str, float]:
    """``is_exact(model)``: whether accumulated micro-batches give exactly the global batch's gradient, judged
    by measuring one step both ways (:func:`accumulation_gap`) on each of ``models``. Returns the gaps."""
    gaps = {name: accumulation_gap(model, image=image) for name, model in models.items()}
    for name, model in models.items():
        exact, said = gaps[name] < 1e-9, is_exact(model)
        if not isinstance(said, bool):
            raise WrongAnswer(f"{name}: return True or False, not {said!r}")
        if said != exact:
            raise WrongAnswer(f"{name}: you say {'exact' if said else 'not exact'}; one step measured both ways "
                              f"differs by {gaps[name]:.1e} of the largest gradient. Which of its layers look at "
                              "more than one image at a time?")
    passed(", ".join(f"{name} {'exact' if g < 1e-9 else f'off by {g:.0e}'}" for name, g in gaps.items())
           + ". BatchNorm normalises each image with the mean and variance of the batch it arrives in: micro-batches "
           "see other statistics than the whole batch. GroupNorm and an MLP look at one image at a time, so their "
           "accumulated gradient is the whole batch's up to rounding. Under DDP each rank's batch is such a "
           "micro-batch (notebook 03)")
    return gaps


def accumulation_models(channels: int, classes: int, skip: str = "") -> dict[str, Any]:
    """Notebook 01's exercise: the course's models under neutral names (which is exact is the question), in the
    order of ``("cnn", "cnn-gn", "mlp")``, ``skip`` left out (the notebook's own model, passed under its name)."""
    from ..models import build_model

    names = [n for n in ("cnn", "cnn-gn", "mlp") if n != skip]
    return {f"model {chr(ord('A') + k)}": build_model(n, channels, classes) for k, n in enumerate(names)}


# --------------------------------------------------------------------------- #
# 02: what a ring all-reduce sends
# --------------------------------------------------------------------------- #
def check_ring_bytes(formula: Callable[[int, int], float], measured: Sequence[Mapping[str, float]]) -> None:
    """``formula(nbytes, world)`` against the bytes the hand-written ring counted as it sent them
    (rows of ``world``, ``nbytes``, ``sent_per_rank``), then against world sizes not measured here."""
    for row in measured:
        got, want = formula(int(row["nbytes"]), int(row["world"])), row["sent_per_rank"]
        if not _close(got, want, 0.01):
            raise WrongAnswer(f"{row['world']} ranks, {row['nbytes']:,.0f} bytes: your formula says {got:,.0f} bytes "
                              f"per rank, the ring sent {want:,.0f}")
    for world in (4, 8, 64):
        got, want = formula(2**20, world), 2 * (world - 1) / world * 2**20
        if not _close(got, want, 0.01):
            raise WrongAnswer(f"right for the runs here, but for {world} ranks: {got:,.0f} bytes where each rank "
                              f"sends 2(N-1) chunks of S/N = {want:,.0f}")
    passed("2(N-1)/N x S: under 2S per rank however many ranks there are")


# --------------------------------------------------------------------------- #
# 03: strong scaling
# --------------------------------------------------------------------------- #
STRONG_CASES = ((0.80, {1: 0.10, 2: 0.13, 4: 0.16, 8: 0.20}), (0.05, {1: 0.02, 2: 0.06, 4: 0.07}))
"""(seconds per global step on 1 rank, weak scaling's seconds per step by world size): a compute-bound model, and
one whose all-reduce costs more than its compute; each wrong model below misses one by far more than the
tolerance."""


def _strong_step(one_rank_s: float, weak: Mapping[int, float], n: int) -> float:
    return one_rank_s / n + (weak[n] - weak[1])


def check_strong_step(predict: Callable[[float, Mapping[int, float], int], float], one_rank_s: float,
                      weak: Mapping[int, float]) -> None:
    """``predict(one_rank_s, weak, n)``: the seconds of a strong-scaling global step on ``n`` ranks, from the
    1-rank time of that global step and the weak-scaling runs' seconds per step. Judged on this run's numbers,
    then on :data:`STRONG_CASES`."""
    for t1, w in ((one_rank_s, weak), *STRONG_CASES):
        for n in sorted(w):
            got, want = float(predict(t1, w, n)), _strong_step(t1, w, n)
            if not _close(got, want, 0.01):
                raise WrongAnswer(f"1 rank takes {1e3 * t1:.1f} ms a global step; weak scaling took "
                                  + ", ".join(f"{1e3 * s:.1f} ms at {k}" for k, s in sorted(w.items()))
                                  + f". You predict {1e3 * got:.1f} ms at {n} rank(s). Which part of a step shrinks "
                                  "when each rank gets 1/N of the batch, and which does not?")
    passed("the compute shrinks with each rank's share of the batch; the gradient's all-reduce does not (it is the "
           "model's size, not the batch's), and weak scaling measured what it costs at each N: "
           "T(N) = T1 / N + (weak(N) - weak(1))")


# --------------------------------------------------------------------------- #
# 00: how large a file must be
# --------------------------------------------------------------------------- #
HALF_SPEED_CASES = ((1000.0, 64 * 1024, 100.0), (20_000.0, 16 * 1024, 2000.0), (300.0, 4096, 500.0))
"""(files/s, bytes per file, MiB/s of one large file): a slow shared file system, a fast local disk, a metadata
server far away; chosen so that each wrong model below misses at least one by far more than the tolerance."""


def _half_speed(files_per_s: float, file_bytes: int, big_mib_per_s: float) -> float:
    bandwidth = big_mib_per_s * 2**20
    return max(0.0, 1 / files_per_s - file_bytes / bandwidth) * bandwidth


def check_half_speed_size(size: Callable[[float, int, float], float],
                          measured: Mapping[str, Mapping[str, float]]) -> None:
    """``size(files_per_s, file_bytes, big_mib_per_s)``: bytes per file at which reading files runs at half
    one large file's speed; judged on each folder this run measured (``measured[folder]`` holds the
    three arguments) and on other storage."""
    cases = [(m["files_per_s"], int(m["file_bytes"]), m["big_mib_per_s"], f"{folder} (measured here)")
             for folder, m in measured.items()]
    cases += [(*c, "another file system") for c in HALF_SPEED_CASES]
    for files_per_s, file_bytes, big, where in cases:
        got, want = size(files_per_s, file_bytes, big), _half_speed(files_per_s, file_bytes, big)
        if not _close(float(got), want, 0.05) and not (want < 1024 and abs(float(got) - want) < 1024):
            share = float(got) / (float(got) + want) if float(got) > 0 else 0.0  # the speed files of that size reach
            raise WrongAnswer(f"{where}: {files_per_s:,.0f} files/s of {file_bytes / 1024:,.0f} KiB, one large file "
                              f"at {big:,.0f} MiB/s: by these rates, files of your {float(got) / 1024:,.1f} KiB "
                              f"would read at {share:.0%} of the large file's speed, not 50%. How much of a small "
                              "file's time is its bytes?")
    passed("a file costs a fixed time plus its bytes; at this size the two are equal")
