#!/usr/bin/env python
"""The first GPU run that counts (`make gpu-check`): every notebook under nbval, the single-device
ladder on ResNet-18, and bf16 matmul TFLOP/s, in one report (Markdown and JSON).

    make gpu-check                                  # on a GPU node, the full profile
    python scripts/gpu_check.py --cpu               # this runner end to end on a CPU (CI tests it)
    python scripts/gpu_check.py --notebooks 01 06   # some notebooks only

Each notebook runs in its own pytest process (`--nbval-lax`, COURSE_PROFILE as given) with a
time limit of its own, so one that hangs costs its limit and the rest still run. While it runs,
NVML samples the memory used on every visible GPU: the report's peak is the most above what the
GPUs held before it started (its forked and launched ranks included). This process starts CUDA
only at the end, for the matmul measurement, after every notebook has run.

The report: per notebook pass/fail, cells passed and wall time; the ladder in images/s (the fp32
textbook loop and each optimisation, side by side in one run); measured matmul TFLOP/s per format;
the best rung's training FLOP/s as a share of the bf16 matmul rate. Written to --out (report.md,
report.json, one log per notebook).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

from course_utils.hardware import environment_report, hardware_label
from course_utils.launch import child_env
from course_utils.paths import REPO_ROOT, SCRIPTS

NOTEBOOKS = REPO_ROOT / "notebooks"


class GpuMemorySampler:
    """The peak memory used on the visible GPUs (MiB, summed over GPUs) while a block runs, from NVML.

    NVML sees every process's memory, the ranks a notebook forks or launches included, without
    starting CUDA here. Where NVML is missing (no NVIDIA driver) ``peak_mib`` is ``None``.
    """

    def __init__(self, interval_s: float = 0.2) -> None:
        self.interval_s, self.peak_mib, self._stop = interval_s, None, threading.Event()
        self._handles: list[Any] = []
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml = pynvml
            visible = os.environ.get("CUDA_VISIBLE_DEVICES")
            indices = range(pynvml.nvmlDeviceGetCount())
            if visible not in (None, ""):  # NVML counts every GPU of the node; the job sees these
                indices = [int(i) for i in visible.split(",") if i.strip().isdigit()]
            self._handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in indices]
        except Exception:
            self._nvml = None

    def _used_mib(self) -> float:
        return sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles) / 2**20

    def __enter__(self) -> GpuMemorySampler:
        if self._nvml and self._handles:
            self._base, self.peak_mib = self._used_mib(), 0.0
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mib = max(self.peak_mib, self._used_mib() - self._base)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.peak_mib is not None:
            self._thread.join()


def run_notebook(path: Path, profile: str, timeout_s: int, cell_timeout_s: int, logs: Path) -> dict[str, Any]:
    """One notebook under nbval in its own pytest process: passed/failed, cells, wall time, peak GPU memory."""
    cmd = [sys.executable, "-m", "pytest", str(path), "--nbval-lax", f"--nbval-cell-timeout={cell_timeout_s}",
           "-p", "no:cacheprovider", "-q", "-o", "addopts="]
    env = child_env({"COURSE_PROFILE": profile})
    log = logs / f"{path.stem}.log"
    start = time.perf_counter()
    with GpuMemorySampler() as memory, open(log, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = -1, True
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", text)}
    return {"notebook": path.name, "passed": code == 0, "timed_out": timed_out, "cells_passed": counts.get("passed", 0),
            "cells_failed": counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0),
            "seconds": round(seconds, 1), "peak_gpu_mib": None if memory.peak_mib is None else round(memory.peak_mib),
            "log": str(log)}


def run_ladder(model: str, args: list[str], out: Path, timeout_s: int, profile: str) -> dict[str, Any]:
    """scripts/benchmark_single.py in its own process; its JSON, or why it failed."""
    target = out / "ladder.json"
    cmd = [sys.executable, str(SCRIPTS / "benchmark_single.py"), "--model", model, "--json", str(target), *args]
    try:
        run = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env({"COURSE_PROFILE": profile}), capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s} s"}
    (out / "ladder.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not target.exists():
        return {"error": f"exit code {run.returncode}: {(run.stderr or run.stdout).strip()[-400:]}"}
    return json.loads(target.read_text())


def training_share(ladder: dict[str, Any], matmul: list[dict[str, Any]], flops_per_image: float) -> dict[str, Any]:
    """The best rung's training FLOP/s against the fastest matmul format measured (bf16 on a GPU)."""
    kept = [r for r in ladder.get("rungs", []) if r["status"] == "kept"]
    if not kept or not matmul:
        return {}
    best = max(kept, key=lambda r: r["images_per_s"])
    peak = max(matmul, key=lambda r: r["tflops"])
    achieved = best["images_per_s"] * flops_per_image / 1e12
    return {"rung": best["rung"], "images_per_s": best["images_per_s"], "train_tflops": achieved,
            "matmul_format": peak["format"], "matmul_tflops": peak["tflops"], "share": achieved / peak["tflops"]}


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu-check: {report['hardware']}", "",
             f"{report['started']}, profile `{report['profile']}`, torch {report['torch']}, "
             f"{report['seconds']:.0f} s in all", "", "## Notebooks", "",
             "| notebook | result | cells passed | failed | wall s | peak GPU MiB |", "|---|---|---:|---:|---:|---:|"]
    for n in report["notebooks"]:
        result = "pass" if n["passed"] else ("not run (budget)" if n.get("not_run") else
                                             "timed out" if n["timed_out"] else "FAIL")
        peak = "n/a" if n["peak_gpu_mib"] is None else f"{n['peak_gpu_mib']:,}"
        lines.append(f"| {n['notebook']} | {result} | {n['cells_passed']} | {n['cells_failed']} | {n['seconds']:.1f} "
                     f"| {peak} |")
    ladder = report["ladder"]
    lines += ["", f"## Single-device ladder ({report['ladder_model']})", ""]
    if "error" in ladder:
        lines.append(f"failed: {ladder['error']}")
    else:
        lines += ["| rung | status | images/s | vs fp32 textbook |", "|---|---|---:|---:|"]
        for r in ladder["rungs"]:
            ips = "" if r["images_per_s"] != r["images_per_s"] else f"{r['images_per_s']:,.0f}"
            sp = "" if r["speedup"] != r["speedup"] else f"{r['speedup']:.2f}x"
            lines.append(f"| {r['rung']} | {r['status']} | {ips} | {sp} |")
        lines.append(f"\nbest: {ladder['best_speedup']:.2f}x the fp32 textbook loop, measured side by side in one run")
    lines += ["", "## Matmul throughput", "", "| format | TFLOP/s | vs fp32 |", "|---|---:|---:|"]
    lines += [f"| {r['format']} | {r['tflops']:.1f} | {r['vs_fp32']:.1f}x |" for r in report["matmul"]]
    share = report["training_share"]
    if share:
        lines += ["", f"The best rung ({share['rung']}) trains at {share['train_tflops']:.2f} TFLOP/s: "
                      f"{share['share']:.1%} of the measured {share['matmul_format']} matmul rate "
                      f"({share['matmul_tflops']:.1f} TFLOP/s)."]
    return "\n".join(lines) + "\n"


def pick_notebooks(wanted: list[str] | None) -> list[Path]:
    found = sorted(NOTEBOOKS.glob("[0-9][0-9]_*.ipynb"))
    if not wanted:
        return found
    chosen = [p for p in found if any(p.name.startswith(w) for w in wanted)]
    missing = [w for w in wanted if not any(p.name.startswith(w) for p in found)]
    if missing:
        raise SystemExit(f"error: no notebook starts with {', '.join(missing)} (there are: "
                         f"{', '.join(p.name[:2] for p in found)})")
    return chosen


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the ci profile, a small ladder and matmul (proves the runner and the report)")
    p.add_argument("--notebooks", nargs="*", help="notebook numbers, e.g. 00 06 (default: all)")
    p.add_argument("--profile", choices=("ci", "full"), help="COURSE_PROFILE for the notebooks (default: full; "
                                                                "ci with --cpu)")
    p.add_argument("--notebook-timeout", type=int, default=600, help="seconds per notebook (default: 600)")
    p.add_argument("--budget-min", type=float, default=17.0,
                   help="start no notebook after this many minutes, so that the ladder and the report still fit "
                        "in 20 minutes (default: 17); the report lists those not run")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu-check")
    args = p.parse_args(argv)
    notebooks = pick_notebooks(args.notebooks)
    profile = args.profile or ("ci" if args.cpu else "full")
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)

    env = environment_report()  # the GPU facts from a child process: no CUDA here yet
    if not env["gpus"] and not args.cpu:
        print("error: no usable GPU here (torch.cuda.is_available() is False in a fresh process). Run this on a GPU "
              "node, or add --cpu to check the runner itself.", file=sys.stderr)
        return 2
    device = "cpu" if args.cpu else "cuda"
    hardware = hardware_label(env, device)
    print(f"gpu-check on {hardware}: {len(notebooks)} notebook(s), profile {profile}", flush=True)
    started, t0 = time.strftime("%Y-%m-%d %H:%M"), time.perf_counter()

    results = []
    for path in notebooks:
        if time.perf_counter() - t0 > 60 * args.budget_min:
            results.append({"notebook": path.name, "passed": False, "timed_out": False, "not_run": True,
                            "cells_passed": 0, "cells_failed": 0, "seconds": 0.0, "peak_gpu_mib": None, "log": ""})
            print(f"  {path.name:38s} not run: past --budget-min {args.budget_min:g}", flush=True)
            continue
        r = run_notebook(path, profile, args.notebook_timeout, args.notebook_timeout, logs)
        results.append(r)
        peak = "" if r["peak_gpu_mib"] is None else f", peak {r['peak_gpu_mib']:,} MiB on the GPU(s)"
        print(f"  {path.name:38s} {'pass' if r['passed'] else 'FAIL'}  {r['cells_passed']} cells, "
              f"{r['seconds']:.0f} s{peak}", flush=True)

    model = "cnn" if args.cpu else "resnet18"
    ladder_args = ["--batch-size", "32", "--steps", "3", "--untimed-steps", "1", "--workers", "1"] if args.cpu else []
    print(f"  ladder ({model}) ...", flush=True)
    ladder = run_ladder(model, ladder_args, args.out, 600, profile)

    import torch  # CUDA starts here, after every notebook

    from course_utils.hardware import matmul_table
    from course_utils.ladder import train_flops_per_image

    matmul = matmul_table(device, n=512 if args.cpu else 8192, repeats=3 if args.cpu else 20)
    share = training_share(ladder, matmul, train_flops_per_image(model)) if "error" not in ladder else {}
    report = {"hardware": hardware, "started": started, "profile": profile, "torch": torch.__version__,
              "environment": env, "notebooks": results, "ladder_model": model, "ladder": ladder, "matmul": matmul,
              "training_share": share, "seconds": time.perf_counter() - t0}
    (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "report.md").write_text(markdown(report))
    print(f"\n{markdown(report)}\nwritten: {args.out / 'report.md'} and report.json", flush=True)
    return 0 if all(r["passed"] for r in results) and "error" not in ladder else 1


if __name__ == "__main__":
    sys.exit(main())
