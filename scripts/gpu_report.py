"""gpu-check's report (report.json and report.md, rewritten after every notebook so a run stopped from outside
keeps what it finished) and the record of a run for records/gpu (scripts/gpu_records.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]


def result_words(n: dict[str, Any]) -> str:
    if n.get("not_run"):
        return "not run (budget)"
    if n.get("stopped_by_budget"):
        return "stopped (budget)"
    return "pass" if n["passed"] else ("timed out" if n.get("timed_out") else "FAIL")


def _older(n: dict[str, Any]) -> str:
    return " (older code)" if n.get("older_code") else ""


def markdown(report: dict[str, Any]) -> str:
    lines = [f"# gpu-check: {report['hardware']}", "",
             f"Latest run {report['started']}, profile `{report['profile']}`, torch {report['torch']}, "
             f"{report['seconds']:.0f} s. Each notebook's latest result, with the hardware and date it ran on; "
             "`make gpu-check` again resumes (what passed on this hardware is skipped; `--rerun` runs it again).",
             "", "## Notebooks", "",
             "| notebook | profile | result | cells passed | failed | wall s | peak GPU MiB | hardware | date |",
             "|---|---|---|---:|---:|---:|---:|---|---|"]
    for n in sorted(report["notebooks"], key=lambda n: (n["notebook"], n.get("profile") or "")):
        peak = "n/a" if n.get("peak_gpu_mib") is None else f"{n['peak_gpu_mib']:,}"
        lines.append(f"| {n['notebook']} | {n.get('profile') or ''} | {result_words(n)}{_older(n)} "
                     f"| {n.get('cells_passed', 0)} | {n.get('cells_failed', 0)} | {n.get('seconds', 0.0):.1f} | {peak} "
                     f"| {n.get('hardware') or ''} | {n.get('date') or ''} |")
    ladder = report["ladder"]
    lines += ["", f"## Single-device ladder ({report['ladder_model']})", ""]
    if ladder.get("hardware"):
        lines += [f"{ladder['hardware']}, {ladder.get('date', '')}, profile `{ladder.get('profile', '')}`", ""]
    if "not_run" in ladder:
        lines.append(f"not measured yet: {ladder['not_run']}")
    elif "error" in ladder:
        lines.append(f"failed: {ladder['error']}")
    else:
        lines += ["| rung | status | images/s | vs fp32 textbook |", "|---|---|---:|---:|"]
        for r in ladder["rungs"]:
            ips = "" if r["images_per_s"] != r["images_per_s"] else f"{r['images_per_s']:,.0f}"
            sp = "" if r["speedup"] != r["speedup"] else f"{r['speedup']:.2f}x"
            lines.append(f"| {r['rung']} | {r['status']} | {ips} | {sp} |")
        lines.append(f"\nbest: {ladder['best_speedup']:.2f}x the fp32 textbook loop, measured side by side in one run")
    lines += ["", "## Matmul throughput" + (f" ({ladder['hardware']})" if ladder.get("hardware") else ""), "",
              "| format | TFLOP/s | vs fp32 |", "|---|---:|---:|"]
    lines += [f"| {r['format']} | {r['tflops']:.1f} | {r['vs_fp32']:.1f}x |" for r in report["matmul"]]
    traces = report.get("traces") or {"not_run": "not yet"}
    lines += ["", "## Per-rank traces (notebook 03's section 8)", ""]
    if "not_run" in traces or "error" in traces:
        lines.append(f"not measured: {traces.get('not_run') or traces['error']}")
    else:
        lines += [f"{traces['hardware']}, {traces['date']}: {traces['model']} on {traces['ranks']} rank(s)", "",
                  "```", traces["table"], "```"]
    lm = report.get("transformer") or {"layouts": {}}
    lines += ["", "## The transformer (scripts/train_lm.py)", ""]
    if not lm["layouts"]:
        lines.append("not measured yet")
    else:
        lines += [f"{lm['hardware']}, {lm['date']}: the {lm['size']} decoder, {lm['seq_len']} tokens a sequence, "
                  f"{lm['batch_per_rank']} a rank", "", "| layout | precision | tokens/s | per device | MFU | peak MiB | "
                  "last loss |", "|---|---|---:|---:|---:|---:|---:|"]
        for name, r in lm["layouts"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:120]} | | | | | |")
                continue
            mfu = f"{r['mfu']:.1%}" if r.get("mfu") else "(a CPU: none)"
            lines.append(f"| {name} | {r['precision']} | {r['tokens_per_s'] or 0:,.0f} | "
                         f"{r['tokens_per_s_per_device'] or 0:,.0f} | {mfu} | {r['peak_memory_mib'] or 0:,.0f} | "
                         f"{r['loss']:.4f} |")
    share = report["training_share"]
    if share:
        lines += ["", f"The best rung ({share['rung']}) trains at {share['train_tflops']:.2f} TFLOP/s: "
                      f"{share['share']:.1%} of the measured {share['matmul_format']} matmul rate "
                      f"({share['matmul_tflops']:.1f} TFLOP/s)."]
    return "\n".join(lines) + "\n"


def load_report(path: Path) -> dict[str, Any]:
    """The report of the runs before this one (each notebook's latest result), or {} for a first run."""
    try:
        report = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        path.replace(path.with_suffix(".json.bad"))
        print(f"note: {path} could not be read ({exc}); kept as {path.name}.bad, starting a new report", flush=True)
        return {}
    for r in report.get("notebooks", []):  # a report from before results kept their own hardware and date
        r.setdefault("hardware", report.get("hardware"))
        r.setdefault("profile", report.get("profile"))
        r.setdefault("date", report.get("started"))
    return report


def _driver() -> str | None:
    """The NVIDIA driver's version (nvidia-smi), or None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.split("\n")[0].strip() or None if out.returncode == 0 else None


def _commit() -> str | None:
    """The commit this tree is (COURSE_COMMIT where the tree came without .git: a lent machine's copy), with
    "+changes" where files differ from it."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True,
                              text=True, timeout=30)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO_ROOT,
                               capture_output=True, text=True, timeout=30).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return os.environ.get("COURSE_COMMIT")
    if head.returncode != 0:
        return os.environ.get("COURSE_COMMIT")
    return head.stdout.strip() + ("+changes" if dirty else "")


def make_record(started: str, machine: dict[str, Any], profile: str, results: list[dict[str, Any]],
                ladder: dict[str, Any], matmul: list[dict[str, Any]], share: dict[str, Any], argv: list[str] | None,
                cpu: bool, traces: dict[str, Any] | None = None, transformer: dict[str, Any] | None = None) -> dict:
    """This run's record for records/gpu (scripts/gpu_records.py): the machine, the commit, each notebook it ran."""
    env = machine["env"]
    measured = "rungs" in ladder and ladder.get("date") == started
    keep = ("notebook", "profile", "content", "passed", "cells", "cells_passed", "cells_failed", "seconds", "peak_gpu_mib")
    return {"date": started, "source": " ".join(["scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
            "commit": _commit(), "hardware": machine["hardware"], "gpus": len(env.get("gpus") or []),
            "driver": None if cpu else _driver(), "torch": env.get("torch"), "cuda": env.get("cuda_runtime"),
            "nccl": env.get("nccl"), "cpu": f"{env.get('cpu')}, {env.get('cores_usable')} cores", "profile": profile,
            "notebooks": [{**{k: r.get(k) for k in keep}, "result": result_words(r)} for r in results],
            "ladder": ladder if measured else None, "matmul": matmul if measured else [],
            "training_share": share if measured else {},
            "traces": traces if traces and traces.get("date") == started else None,
            "transformer": transformer if transformer and transformer.get("date") == started else None,
            **({"matmul_size": "512 x 512, 3 repeats" if cpu else "8192 x 8192, 20 repeats"} if measured else {})}

