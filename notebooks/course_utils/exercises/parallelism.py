"""Notebook 09: the interleaved pipeline's bubble, a tensor-parallel plan. Notebook 12: the experts' capacity."""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

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
           "of them: (p-1)/(v*m+p-1); more chunks shrink the bubble at the price of more sends")


# --------------------------------------------------------------------------- #
# 09: a tensor-parallel plan for Llama's MLP, run on the ranks
# --------------------------------------------------------------------------- #
SWIGLU_PARTS = ("gate", "up", "down")


def run_tp_plans(plans: Sequence[Mapping[str, Any]], device: str = "cpu", ranks: int = 2) -> list[dict[str, Any]]:
    """Each plan run by ``scripts/tp_plan.py`` on ``ranks`` processes, in one launch: its row of the RESULT
    (an error, or the gaps to the unsplit module, the share of the weights a rank holds, the collectives)."""
    import torch

    from ..launch import run_script
    from ..results import parse_result

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "plans.pt"
        torch.save([dict(plan) for plan in plans], path)
        run = run_script("tp_plan.py", ["--device", device, "--plans", path], nproc=ranks, timeout_s=300, echo=False)
    return parse_result(run.output)["plans"]


def tp_plan_verdict(row: Mapping[str, Any], ranks: int, tol: float = 1e-5) -> str | None:
    """Why a plan's run is not Megatron's split of the MLP, or None if it is."""
    if row["error"]:
        return (f"your plan did not run: {row['error'].rstrip('.')}. Each style decides how a layer's weight is split and what "
                "layout its input and output have: do the layers' layouts meet?")
    if row["output_gap"] > tol or row["input_grad_gap"] > tol:
        return (f"the split module computes something else: output off by {row['output_gap']:.1e}, input gradient by "
                f"{row['input_grad_gap']:.1e}. Which hidden units does each rank multiply together?")
    if row["weight_share"] > 1 / ranks + 1e-9:
        return (f"each rank holds {row['weight_share']:.0%} of the weights, not 1/{ranks}: a layer is left whole "
                "on every rank")
    forward = {op: n for op, n in row["forward"].items() if n}
    if forward != {"all_reduce": 1}:
        return (f"the forward pass ran {forward or 'no collective'}, where Megatron's split of an MLP runs one "
                "all-reduce, after its last layer")
    return None


def check_tp_plan(plan: Callable[[], Mapping[str, Any]], device: str = "cpu", ranks: int = 2) -> None:
    """``plan()`` -> ``parallelize_module``'s plan for :class:`course_utils.tensor_parallel.SwiGLU`, run on ``ranks``
    processes: the unsplit module's output and input gradient, 1/ranks of the weights on each rank, one
    all-reduce forward."""
    from torch.distributed.tensor.parallel import ParallelStyle

    got = plan()
    if not isinstance(got, Mapping) or not all(isinstance(v, ParallelStyle) for v in got.values()):
        raise WrongAnswer(f"a plan is a dict from submodule name to a ParallelStyle (ColwiseParallel(), ...), "
                          f"not {got!r}")
    unknown = sorted(set(got) - set(SWIGLU_PARTS))
    if unknown:
        raise WrongAnswer(f"SwiGLU has no submodule {', '.join(unknown)}: its linear layers are {', '.join(SWIGLU_PARTS)}")
    (row,) = run_tp_plans([got], device, ranks)
    verdict = tp_plan_verdict(row, ranks)
    if verdict:
        raise WrongAnswer(verdict)
    print(f"your plan on {ranks} ranks ({device}): output off by {row['output_gap']:.1e}, input gradient by "
          f"{row['input_grad_gap']:.1e}; each rank holds {row['weight_share']:.0%} of the weights; forward "
          f"{row['forward']} ({sum(row['forward_bytes'].values()):,} B), backward {row['backward']}")
    passed("gate and up split by output features alike, down by input features: one all-reduce forward")


# (load per expert, tokens, experts, top_k): loads a router could give, their even shares not always whole
CAPACITY_CASES = [([5, 9, 3, 7], 12, 4, 2), ([10, 4, 6], 10, 3, 2), ([300, 20, 80, 112, 0, 500, 12, 0], 512, 8, 2)]


def check_no_drop_capacity(capacity: Callable[[Sequence[int], int, int, int], float], moe: Any,
                           tokens: Any) -> None:
    """``capacity(load, tokens, experts, top_k)``: the smallest capacity factor at which no expert gets more
    assignments than its capacity. Judged on ``moe``'s routing of ``tokens`` (routed again: nothing dropped at the
    answer, something at the next capacity down), then on loads not measured here."""
    from ..parallel.experts import capacity_for

    with torch.no_grad():
        moe.capacity_factor = None
        moe.route(tokens)
        load, n = list(moe.stats["load"]), tokens.shape[0]
        cases = [(load, n, moe.experts, moe.top_k), *CAPACITY_CASES]
        for i, (case_load, case_n, experts, top_k) in enumerate(cases):
            try:
                factor = float(capacity(list(case_load), case_n, experts, top_k))
            except (TypeError, ValueError) as exc:
                raise WrongAnswer(f"capacity(...) returns a number, the capacity factor: {exc}") from None
            if not math.isfinite(factor) or factor <= 0:
                raise WrongAnswer(f"a capacity factor is a positive number, not {factor!r}")
            got, need = capacity_for(factor, case_n, experts, top_k), max(case_load)
            where = ("this run's routing" if i == 0
                     else f"load {case_load} ({case_n} tokens, {experts} experts, top {top_k})")
            if got < need:
                raise WrongAnswer(f"on {where}: {factor:.4f} gives each expert {got} assignments, and the busiest "
                                  f"has {need}: it drops some")
            if got > need:
                raise WrongAnswer(f"on {where}: {factor:.4f} gives each expert {got} assignments, more than the "
                                  f"busiest needs ({need}): a smaller factor drops nothing either")
            if i == 0:  # the run itself: routed again at the answer, and at the capacity just below
                moe.capacity_factor = factor
                moe.route(tokens)
                kept_all = moe.stats["dropped"] == 0
                moe.capacity_factor = (need - 1) * experts / (case_n * top_k)
                moe.route(tokens)
                dropped_below = moe.stats["dropped"]
                if not kept_all or not dropped_below:
                    raise WrongAnswer(f"routed again at {factor:.4f}, the layer dropped assignments, or none one "
                                      "capacity below: the load it was given is not the layer's")
                first = factor
        moe.capacity_factor = None
    print(f"capacity factor {first:.3f} on this run: {n:,} tokens, {moe.top_k} experts each, no assignment dropped; "
          f"one capacity less, {dropped_below} dropped; and right on {len(CAPACITY_CASES)} loads not measured here")
    passed("the busiest expert's load over the even share (tokens x top_k / experts) is the smallest factor")
