"""Notebook 09: the interleaved pipeline's bubble, a tensor-parallel plan."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .core import WrongAnswer, _close, passed


# --------------------------------------------------------------------------- #
# 09: the interleaved pipeline's bubble
# --------------------------------------------------------------------------- #
# (stages, micro-batches, chunks per rank) -> the share of the step a rank waits
BUBBLE_CASES = {(2, 1, 1): 0.5, (4, 12, 1): 0.2, (8, 32, 4): 7 / 135, (4, 8, 2): 3 / 19, (16, 16, 8): 15 / 143,
                (1, 8, 2): 0.0}


def check_interleaved_bubble(bubble: Callable[[int, int, int], float], measured: Sequence[Mapping[str, Any]],
                             stages: int) -> None:
    """``bubble(stages, microbatches, chunks)``: the share of a pipeline step a rank waits when each of the
    ``stages`` ranks runs ``chunks`` model chunks. Judged against this run's timed steps, every schedule
    (within 0.05, plus what the sends and Python cost on top, measured apart: ``bare_s``), then exactly
    against layouts not run here."""
    for row in measured:
        got = bubble(stages, row["microbatches"], row.get("chunks", 1))
        slack = 0.05 + 3 * row["bare_s"] / row["step_s"]
        if not (math.isfinite(got) and abs(got - row["bubble"]) <= slack):
            raise WrongAnswer(f"{stages} ranks, {row['microbatches']} micro-batches, {row.get('chunks', 1)} chunk(s) per "
                              f"rank ({row['schedule']}): you say {got:.3f}, this run measured {row['bubble']:.3f}")
    for (p, m, v), want in BUBBLE_CASES.items():
        got = bubble(p, m, v)
        if not _close(got, want, 1e-9):
            hint = (" With v chunks a micro-batch's slot on a rank is v times shorter: how many of those short "
                    "slots does filling and draining the pipeline take, and how many does a rank work in?") if v > 1 else ""
            raise WrongAnswer(f"close to this run's measurements, but {p} ranks, {m} micro-batches, {v} chunk(s) per "
                              f"rank: you say {got:.4f}, the schedule idles {want:.4f} of the step.{hint}")
    passed("each rank works in v*m slots of 1/v of a micro-batch's time and the pipeline fills and drains in p-1 "
           "of them: (p-1)/(v*m+p-1); more chunks shrink the bubble at the price of v times the sends")
