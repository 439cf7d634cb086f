"""course_utils.traces: the interval arithmetic, and both kinds of trace it reads (a CPU trace's threads, a GPU
trace's streams), on traces written out here in the profiler's format with known answers. Notebook 03 reads the
real per-rank traces of its DDP run (and on GPUs puts Holistic Trace Analysis beside them): those checks live
there. The GPU reading is checked against HTA here, on the same hand-written trace, because CI has no GPU."""

import json

import pytest

from course_utils.launch import run_script
from course_utils.results import parse_result
from course_utils.traces import breakdown, intersect, merge, step_timeline


def test_interval_arithmetic():
    assert merge([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert intersect([(0, 10)], [(2, 3), (5, 12)]) == [(2, 3), (5, 10)]
    assert intersect([(0, 1)], [(1, 2)]) == []


def op(name, ts, dur, tid, cat="cpu_op", **extra):
    return {"ph": "X", "cat": cat, "name": name, "pid": 1, "tid": tid, "ts": ts, "dur": dur, **extra}


def write(folder, rank, events, backend="gloo"):
    folder.mkdir(exist_ok=True)
    trace = {"schemaVersion": 1, "distributedInfo": {"backend": backend, "rank": rank, "world_size": 2},
             "traceEvents": events}
    (folder / f"rank{rank}.json").write_text(json.dumps(trace))


def test_cpu_trace_main_thread_computes_gloo_threads_communicate(tmp_path):
    """Two 100 us steps: the main thread computes 0-60 and 70-80 of each; gloo's thread all-reduces 50-90.
    Compute 70, communication 40, of which 10 ran beside compute (50-60) and 10 (70-80): 20 hidden; idle 60-70
    is inside the all-reduce, so only 90-100 is idle."""
    events = []
    for start in (0, 100):
        events += [op(f"ProfilerStep#{start // 100 + 3}", start, 100, tid=7, cat="user_annotation"),
                   op("aten::conv2d", start, 60, tid=7), op("aten::relu", start + 10, 5, tid=7),
                   op("Optimizer.step#SGD.step", start + 70, 10, tid=7),
                   op("gloo:all_reduce", start + 50, 40, tid=9)]
    events.append(op("aten::mm", 250, 10, tid=7))  # after the profiled steps: not counted
    write(tmp_path, 1, events)
    (r,) = breakdown(tmp_path)
    assert (r.rank, r.where, r.steps) == (1, "CPU threads", 2)
    assert (r.step_ms * 1e3, r.compute_ms * 1e3, r.comm_ms * 1e3, r.overlap_ms * 1e3, r.idle_ms * 1e3) == \
        pytest.approx((100, 70, 40, 20, 10))
    assert r.overlap_pct == pytest.approx(50) and r.exposed_ms * 1e3 == pytest.approx(20)
    timeline = step_timeline(tmp_path, step=1)
    assert timeline[1]["communication"] == [pytest.approx((0.05, 0.09))]


def gpu_events(shift):
    """A GPU trace's shape: the CPU launches (ProfilerStep, cuda_runtime) ahead of the kernels on stream 7; per
    step a compute kernel 0-600 us and NCCL's all-reduce 400-900 us after the step's start, plus a memcpy."""
    events = []
    for k, start in enumerate((0, 1000)):
        start += shift
        corr = 10 * k
        events += [op(f"ProfilerStep#{k + 2}", start, 1000, tid=1, cat="user_annotation"),
                   op("aten::conv2d", start + 5, 50, tid=1, **{"args": {"External id": corr + 1}}),
                   op("cudaLaunchKernel", start + 10, 5, tid=1, cat="cuda_runtime",
                      args={"correlation": corr + 1, "External id": corr + 1}),
                   op("c10d::allreduce_", start + 20, 5, tid=1, args={"External id": corr + 2}),
                   op("cudaLaunchKernel", start + 21, 3, tid=1, cat="cuda_runtime",
                      args={"correlation": corr + 2, "External id": corr + 2}),
                   op("cudaMemcpyAsync", start + 30, 3, tid=1, cat="cuda_runtime",
                      args={"correlation": corr + 3, "External id": corr + 3}),
                   op("implicit_convolve_sgemm", start, 600, tid=7, cat="kernel",
                      args={"correlation": corr + 1, "External id": corr + 1, "stream": 7, "device": 0}),
                   op("ncclDevKernel_AllReduce_Sum_f32_RING_LL", start + 400, 500, tid=7, cat="kernel",
                      args={"correlation": corr + 2, "External id": corr + 2, "stream": 7, "device": 0}),
                   op("Memcpy DtoH (Device -> Pinned)", start + 920, 30, tid=7, cat="gpu_memcpy",
                      args={"correlation": corr + 3, "External id": corr + 3, "stream": 7, "device": 0})]
    for e in events:
        if e["tid"] == 7:
            e["pid"] = 0
    return events


def test_gpu_trace_kernels_nccl_is_communication_and_hta_agrees(tmp_path):
    """Per step: compute 600 us, communication 500 us of which 200 beside compute (40%). Idle, where not even the
    copy runs: 70 us in the first step, 20 in the last (its window ends with its copy): 45 per step, as HTA has
    it (90 of 1950 us)."""
    for rank in (0, 1):
        write(tmp_path, rank, gpu_events(shift=5 * rank), backend="nccl")
    rows = breakdown(tmp_path)
    assert [r.rank for r in rows] == [0, 1] and {r.where for r in rows} == {"GPU streams"}
    for r in rows:
        assert (r.compute_ms * 1e3, r.comm_ms * 1e3, r.overlap_ms * 1e3) == pytest.approx((600, 500, 200))
        assert r.idle_ms * 1e3 == pytest.approx(45) and r.overlap_pct == pytest.approx(40)

    # the same traces read by Holistic Trace Analysis, as notebook 03 reads them on GPUs (its own process: HTA
    # configures the process's logging)
    run = run_script("trace_analysis.py", [tmp_path], echo=False)
    result = parse_result(run.output)
    assert result["hta_overlap_pct"] == {"0": pytest.approx(40), "1": pytest.approx(40)}, run.output
    assert result["course_overlap_pct"] == {"0": pytest.approx(40), "1": pytest.approx(40)}
    assert result["hta_idle_pct"]["0"] == pytest.approx(100 * 90 / 1950, abs=0.01)


def test_a_trace_without_profiler_steps_is_refused(tmp_path):
    write(tmp_path, 0, [op("aten::mm", 0, 10, tid=1)])
    with pytest.raises(ValueError, match="ProfilerStep"):
        breakdown(tmp_path)
    with pytest.raises(FileNotFoundError, match="--trace-dir"):
        breakdown(tmp_path / "empty")


def test_hta_is_not_asked_about_cpu_traces(tmp_path):
    write(tmp_path, 0, [op("ProfilerStep#2", 0, 100, tid=7), op("aten::mm", 0, 80, tid=7),
                        op("gloo:all_reduce", 60, 30, tid=9)])
    run = run_script("trace_analysis.py", [tmp_path], echo=False)
    assert "CPU traces" in run.output and parse_result(run.output)["hta_overlap_pct"] is None


def test_a_run_too_short_to_record_says_so(tmp_path):
    """(Notebook 03 records a 2-rank run and reads its traces.) A run that ends before the recorded steps."""
    run = run_script("train.py", ["--epochs", "1", "--steps-per-epoch", "1", "--n-train", "64", "--n-val", "32",
                                  "--batch-size", "16", "--workers", "0", "--no-progress", "--trace-dir", tmp_path],
                     echo=False, env={"OMP_NUM_THREADS": "1"})
    assert "no trace written: the run ended within the 2 steps the profiler skips" in run.output, run.output
    assert not list(tmp_path.glob("*.json"))
