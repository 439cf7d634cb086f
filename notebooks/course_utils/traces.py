"""Where each rank's step goes, read from the profiler's per-rank traces (``train.py --trace-dir``).

``recording(trace_dir, device, rank)`` records three training steps with ``torch.profiler`` on every rank and
writes one Chrome trace per rank (``rank<r>.json``: open it in Perfetto, or give the folder to
Holistic Trace Analysis). ``breakdown(folder)`` reduces each trace to intervals of compute and of
communication and measures, per profiled step, how long each took, how much of the communication ran
while compute did (the overlap DDP's buckets buy), and how long neither ran (idle).

What counts as what depends on what the trace holds:

- a GPU trace: kernels on the CUDA streams; NCCL's kernels are communication, the others compute, as
  HTA classifies them (copies and memsets are neither, but the GPU is not idle while they run);
- a CPU trace (gloo): the main thread's operators are compute, gloo's worker threads'
  ``gloo:*`` spans are communication; while the main thread waits for one, that time is communication alone
  (not hidden), and only time with neither is idle.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Interval = tuple[float, float]  # start, end in microseconds

ACTIVE_STEPS = 3  # steps recorded, after the untimed ones and one of warm-up


@contextlib.contextmanager
def recording(trace_dir: str | Path | None, device: torch.device, rank: int, skip: int = 2) -> Iterator[Any]:
    """A profiler whose ``step()`` the training loop calls after every step (None when ``trace_dir`` is None):
    it skips ``skip`` steps, warms up one, records :data:`ACTIVE_STEPS`, and writes ``trace_dir/rank<rank>.json``."""
    if trace_dir is None:
        yield None
        return
    from torch.profiler import ProfilerActivity, profile, schedule

    out = Path(trace_dir)
    out.mkdir(parents=True, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = out / f"rank{rank}.json"
    with profile(activities=activities, schedule=schedule(wait=max(1, skip), warmup=1, active=ACTIVE_STEPS, repeat=1),
                 on_trace_ready=lambda p: p.export_chrome_trace(str(path))) as prof:
        yield prof
    if not path.exists():
        print(f"rank {rank}: no trace written: the run ended within the {max(1, skip)} steps the profiler skips "
              "(--untimed-steps)", file=sys.stderr, flush=True)


@dataclass
class RankTime:
    """One rank's profiled steps, in milliseconds per step."""

    rank: int
    where: str  # "GPU streams" or "CPU threads"
    steps: int
    step_ms: float
    compute_ms: float
    comm_ms: float
    overlap_ms: float  # communication while compute ran
    idle_ms: float  # nothing ran (on a GPU, not even a copy)

    @property
    def overlap_pct(self) -> float:
        """The share of the communication hidden behind compute (HTA's ``comp_comm_overlap_pctg``)."""
        return 100 * self.overlap_ms / self.comm_ms if self.comm_ms else float("nan")

    @property
    def exposed_ms(self) -> float:
        """Communication that nothing else ran beside: what a rank waits for."""
        return self.comm_ms - self.overlap_ms


def merge(intervals: Sequence[Interval]) -> list[Interval]:
    """The union of ``intervals``, as sorted disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(intervals: Sequence[Interval]) -> float:
    return sum(e - s for s, e in merge(intervals))


def intersect(a: Sequence[Interval], b: Sequence[Interval]) -> list[Interval]:
    """The intersection of two unions of intervals."""
    a, b = merge(a), merge(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append((start, end))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def clip(intervals: Sequence[Interval], window: Interval) -> list[Interval]:
    return intersect(intervals, [window])


def load(path: str | Path) -> dict[str, Any]:
    with open(path) as f:
        return json.load(f)


def rank_of(trace: dict[str, Any]) -> int:
    return int(trace.get("distributedInfo", {}).get("rank", 0))


def _span(e: dict[str, Any]) -> Interval:
    return float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))


def classify(trace: dict[str, Any]) -> tuple[str, list[Interval], list[Interval], list[Interval], list[Interval]]:
    """``(where, steps, compute, communication, other)`` of one trace: the profiled steps' spans (ProfilerStep#k
    on the main thread) and the intervals of compute, of communication and of other work (a GPU's copies)."""
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in spans if str(e["name"]).startswith("ProfilerStep#")]
    if not steps:
        raise ValueError("the trace has no ProfilerStep: record it with the profiler's schedule and step()")
    kernels = [e for e in spans if e.get("cat") == "kernel"]
    if kernels:
        comm = [_span(e) for e in kernels if "nccl" in str(e["name"]).lower()]
        compute = [_span(e) for e in kernels if "nccl" not in str(e["name"]).lower()]
        other = [_span(e) for e in spans if e.get("cat") in ("gpu_memcpy", "gpu_memset")]
        # the GPU runs behind the CPU: each step's window ends where the next begins, the last with its last kernel
        step_spans = [_span(e) for e in steps]
        end = max(e for _, e in comm + compute + other)
        windows = [(s, step_spans[k + 1][0] if k + 1 < len(step_spans) else end) for k, (s, _) in enumerate(step_spans)]
        return "GPU streams", windows, compute, comm, other
    main = steps[0]["tid"]
    compute = [_span(e) for e in spans if e["tid"] == main and not str(e["name"]).startswith("ProfilerStep#")]
    comm = [_span(e) for e in spans if e["tid"] != main and str(e["name"]).startswith("gloo:")]
    return "CPU threads", [_span(e) for e in steps], compute, comm, []


def rank_time(trace: dict[str, Any]) -> RankTime:
    """What one rank's profiled steps spent, per step (see :class:`RankTime`)."""
    where, steps, compute, comm, other = classify(trace)
    c, m, o, wall = [], [], [], 0.0
    for window in steps:
        c += clip(compute, window)
        m += clip(comm, window)
        o += clip(other, window)
        wall += window[1] - window[0]
    n = len(steps)
    busy = length(c + m + o)
    return RankTime(rank=rank_of(trace), where=where, steps=n, step_ms=wall / n / 1e3, compute_ms=length(c) / n / 1e3,
                    comm_ms=length(m) / n / 1e3, overlap_ms=length(intersect(c, m)) / n / 1e3,
                    idle_ms=(wall - busy) / n / 1e3)


def trace_files(trace_dir: str | Path) -> list[Path]:
    files = sorted(Path(trace_dir).glob("rank*.json"), key=lambda p: int(p.stem.removeprefix("rank")))
    if not files:
        raise FileNotFoundError(f"no rank*.json in {trace_dir}: run train.py with --trace-dir {trace_dir}")
    return files


def breakdown(trace_dir: str | Path) -> list[RankTime]:
    """:func:`rank_time` of every rank's trace in ``trace_dir``, by rank."""
    return sorted((rank_time(load(p)) for p in trace_files(trace_dir)), key=lambda r: r.rank)


def breakdown_table(rows: Sequence[RankTime]) -> str:
    out = [f"{'rank':>4s} {'step ms':>8s} {'compute':>8s} {'comm':>8s} {'hidden':>8s} {'idle':>8s} {'% hidden':>9s}"]
    for r in rows:
        out.append(f"{r.rank:4d} {r.step_ms:8.1f} {r.compute_ms:8.1f} {r.comm_ms:8.1f} {r.overlap_ms:8.1f} "
                   f"{r.idle_ms:8.1f} {r.overlap_pct:8.0f}%")
    return "\n".join(out)


def step_timeline(trace_dir: str | Path, step: int = 1) -> dict[int, dict[str, list[Interval]]]:
    """For each rank, the compute and communication intervals of its ``step``-th profiled step, in
    milliseconds from that step's start (what :func:`course_utils.plots.trace_timeline_chart` draws)."""
    out = {}
    for p in trace_files(trace_dir):
        trace = load(p)
        _, steps, compute, comm, _ = classify(trace)
        window = steps[min(step, len(steps) - 1)]
        out[rank_of(trace)] = {name: [((s - window[0]) / 1e3, (e - window[0]) / 1e3) for s, e in merge(clip(ivs, window))]
                               for name, ivs in (("compute", compute), ("communication", comm))}
    return dict(sorted(out.items()))

