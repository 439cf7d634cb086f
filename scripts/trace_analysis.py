#!/usr/bin/env python
"""Holistic Trace Analysis (HTA) of the per-rank traces that ``train.py --trace-dir`` wrote, beside the
course's own reading of them (course_utils.traces)::

    python scripts/trace_analysis.py runs/03_ddp/traces

HTA reads kernels on CUDA streams: for CPU traces (gloo) it has nothing to measure, and this says so. It
configures logging for the whole process when it starts (the root logger at INFO, to stdout), so it runs
here, in a process of its own, not in a notebook's kernel. The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
from pathlib import Path

from course_utils.results import emit_result
from course_utils.traces import breakdown, breakdown_table


def hta_tables(trace_dir: Path):
    """HTA's time per rank on the GPU (compute, non-compute, idle) and its communication-computation overlap."""
    from hta.trace_analysis import TraceAnalysis

    analyzer = TraceAnalysis(trace_dir=str(trace_dir), include_last_profiler_step=True)
    return analyzer.get_temporal_breakdown(visualize=False), analyzer.get_comm_comp_overlap(visualize=False)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("trace_dir", type=Path, help="a folder of rank<r>.json traces (train.py --trace-dir)")
    args = p.parse_args(argv)
    try:
        rows = breakdown(args.trace_dir)
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"course_utils.traces ({rows[0].where}), ms per step:\n{breakdown_table(rows)}")
    course = {r.rank: r.overlap_pct for r in rows}
    if rows[0].where != "GPU streams":
        print("HTA: these are CPU traces, with no kernels on CUDA streams for it to measure")
        emit_result({"course_overlap_pct": course, "hta_overlap_pct": None})
        return 0

    quiet = io.StringIO()  # its logger reports every file it parses, on both streams
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        temporal, overlap = hta_tables(args.trace_dir)
    print("HTA, time per rank on the GPU (us):")
    print(temporal[["rank", "compute_time(us)", "non_compute_time(us)", "idle_time(us)", "idle_time_pctg"]]
          .to_string(index=False))
    print("HTA, communication hidden behind compute:")
    print(overlap.to_string(index=False))
    emit_result({"course_overlap_pct": course,
                 "hta_overlap_pct": {int(r): float(v) for r, v in zip(overlap["rank"], overlap["comp_comm_overlap_pctg"])},
                 "hta_idle_pct": {int(r): float(v) for r, v in zip(temporal["rank"], temporal["idle_time_pctg"])}})
    return 0


if __name__ == "__main__":
    sys.exit(main())
