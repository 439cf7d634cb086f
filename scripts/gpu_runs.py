"""What gpu-check runs, each in a process of its own with a time limit: a notebook under nbval, the single-device
ladder, notebook 03's per-rank traces; and what it reads of the machine (its GPUs, the matmul rates)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gpu_memory import GpuMemorySampler, cuda_uuids

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"


# An IPython startup file of the notebooks' kernels under gpu-check: their file descriptor 2, and so that of every
# process they fork, is a log file, and a crash prints its Python traceback there (faulthandler)
KERNEL_STDERR = """import faulthandler, os
_course_stderr = open(os.environ["COURSE_KERNEL_STDERR"], "a", buffering=1)
os.dup2(_course_stderr.fileno(), 2)
faulthandler.enable(_course_stderr)
"""


def run_notebook(path: Path, profile: str, timeout_s: float, cell_timeout_s: float, logs: Path,
                 gpu_uuids: Sequence[str] = (), executed: Path | None = None, label: str = "") -> dict[str, Any]:
    """One notebook under nbval in its own pytest process: passed/failed, cells, wall time, peak GPU memory.
    With ``executed``, the notebook with its outputs is written there (labelled ``label``) as it runs."""
    from course_utils.paths import child_env

    cmd = [sys.executable, "-m", "pytest", str(path), "--nbval-lax", f"--nbval-cell-timeout={int(cell_timeout_s)}",
           "-p", "no:cacheprovider", "-q", "-o", "addopts=", *(["-p", "record_executed"] if executed else [])]
    # COURSE_NO_APT: the suite's conftest installs nothing here (a GPU node without a network, as root, would
    # otherwise wait on apt-get before every notebook); it says so in the notebook's log instead.
    env = child_env({"COURSE_PROFILE": profile, "COURSE_NO_APT": "1",
                     **({"COURSE_EXECUTED_DIR": str(executed), "COURSE_EXECUTED_LABEL": label} if executed else {})})
    if not executed:  # not into the folder of a make test that runs this (tests/test_gpu_check.py)
        env.pop("COURSE_EXECUTED_DIR", None)
    env["PYTHONPATH"] = os.pathsep.join([str(SCRIPTS), env["PYTHONPATH"]])  # the record_executed plugin
    log = logs / f"{path.stem}.log"
    # nbval sends the kernel's stderr to /dev/null: what the kernel's C++ and the processes it forks (Lightning's
    # ddp_notebook ranks) write there, a crash's traceback included, goes to this file instead
    env["IPYTHONDIR"], env["COURSE_KERNEL_STDERR"] = str(logs / "ipython"), str(logs / f"{path.stem}.stderr.log")
    startup = logs / "ipython" / "profile_default" / "startup"
    startup.mkdir(parents=True, exist_ok=True)
    (startup / "00-kernel-stderr.py").write_text(KERNEL_STDERR)
    start = time.perf_counter()
    with GpuMemorySampler(gpu_uuids) as memory, open(log, "w") as out:
        try:
            code = subprocess.run(cmd, cwd=REPO_ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
                                  timeout=timeout_s).returncode
            timed_out = False
        except subprocess.TimeoutExpired:
            code, timed_out = -1, True
    seconds = time.perf_counter() - start
    text = log.read_text(errors="replace")
    counts = {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)", text)}
    cells_passed = counts.get("passed", 0)
    failed = counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    run = _course_run(executed / path.name) if executed else {}
    if timed_out and run:  # pytest killed says nothing: the executed copy knows how far it got
        cells_passed, failed = run.get("cells_ran", 0) - run.get("errors", 0), run.get("errors", 0)
    return {"notebook": path.name, "passed": code == 0, "timed_out": timed_out, "cells_passed": cells_passed,
            "cells_failed": failed, "cells": run.get("cells") or _code_cells(path), "seconds": round(seconds, 1),
            "peak_gpu_mib": None if memory.peak_mib is None else round(memory.peak_mib), "log": str(log)}


def _course_run(executed: Path) -> dict[str, Any]:
    """What record_executed wrote into an executed notebook: its code cells, those that ran, those that raised."""
    try:
        return json.loads(executed.read_text()).get("metadata", {}).get("course_run", {})
    except (OSError, ValueError):
        return {}


def _code_cells(path: Path) -> int | None:
    try:
        return sum(c["cell_type"] == "code" for c in json.loads(path.read_text())["cells"])
    except (OSError, ValueError, KeyError):
        return None


def run_ladder(model: str, args: list[str], out: Path, timeout_s: float, profile: str) -> dict[str, Any]:
    """scripts/benchmark_single.py in its own process; its JSON, or why it failed."""
    from course_utils.paths import child_env

    target = out / "ladder.json"
    cmd = [sys.executable, str(SCRIPTS / "benchmark_single.py"), "--model", model, "--json", str(target), *args]
    try:
        run = subprocess.run(cmd, cwd=REPO_ROOT, env=child_env({"COURSE_PROFILE": profile}), capture_output=True,
                             text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout_s:.0f} s"}
    (out / "ladder.log").write_text(run.stdout + run.stderr)
    if run.returncode != 0 or not target.exists():
        return {"error": f"exit code {run.returncode}: {(run.stderr or run.stdout).strip()[-400:]}"}
    return json.loads(target.read_text())


def run_traces(out: Path, gpus: int, cpu: bool, timeout_s: float, profile: str) -> dict[str, Any]:
    """Notebook 03's per-rank traces where its DDP cannot run on GPUs (one GPU): train.py records three steps on
    every rank (two ranks on two GPUs or more, else one) and scripts/trace_analysis.py reads them twice, with
    course_utils.traces and with Holistic Trace Analysis. Its RESULT, with the rows; or why it failed."""
    import shutil

    from course_utils.launch import run_script
    from course_utils.results import parse_result, results_in

    folder = out / "traces"
    shutil.rmtree(folder, ignore_errors=True)
    ranks = 2 if gpus >= 2 else 1
    model, batch = ("cnn", 32) if cpu else ("resnet18", 128)
    args = ["--model", model, "--epochs", 1, "--steps-per-epoch", 8, "--n-train", 8 * batch * ranks, "--n-val", 64,
            "--batch-size", batch, "--device", "cpu" if cpu else "cuda", "--workers", 2, "--no-progress",
            "--trace-dir", folder]
    env = {"COURSE_PROFILE": profile}
    begin = time.monotonic()
    train = run_script("train.py", args, nproc=ranks if ranks > 1 else None, timeout_s=timeout_s, env=env,
                       check=False, echo=False)
    if train.returncode != 0 or not results_in(train.output):
        return {"error": f"train.py: exit code {train.returncode}: {train.output.strip()[-400:]}"}
    read = run_script("trace_analysis.py", [folder], timeout_s=max(60.0, timeout_s - (time.monotonic() - begin)), env=env,
                      check=False, echo=False)
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "traces.log").write_text(train.output + read.output)  # the lease brings logs/ back
    if read.returncode != 0 or not results_in(read.output):
        return {"error": f"trace_analysis.py: exit code {read.returncode}: {read.output.strip()[-400:]}"}
    table = read.output[read.output.index("course_utils.traces"):read.output.rindex("RESULT")].rstrip()
    return {**parse_result(read.output), "ranks": ranks, "model": model, "table": table}


def run_transformer(out: Path, gpus: int, cpu: bool, timeout_s: float, profile: str) -> dict[str, Any]:
    """scripts/train_lm.py's tokens/s and MFU (against the GPU's measured bf16 matmul rate): the decoder in one
    process, compiled per block on a GPU (where CI's CPUs do not: inductor's C++ build costs them minutes; its
    losses beside the eager run's), then FSDP2 over every GPU where there are two or more. Each layout's
    numbers; or why it failed."""
    from course_utils.launch import run_script
    from course_utils.results import parse_result, results_in

    size, seq, batch = ("tiny", 64, 8) if cpu else ("base", 1024, 8)
    base = ["--lm-size", size, "--seq-len", seq, "--steps", 10 if cpu else 30, "--log-every", 100,
            "--device", "cpu" if cpu else "cuda"]
    layouts = {"1 process": (None, ["--batch-size", batch])}
    if not cpu:
        layouts["1 process, each block compiled"] = (None, ["--batch-size", batch, "--compile"])
    if gpus >= 2:
        layouts[f"FSDP2 over {gpus} GPUs"] = (gpus, ["--batch-size", batch, "--dp-shard", gpus])
    rows, logs, begin = {}, [], time.monotonic()
    for name, (nproc, extra) in layouts.items():
        left = max(60.0, timeout_s - (time.monotonic() - begin))
        run = run_script("train_lm.py", [*base, *extra], nproc=nproc, timeout_s=left, env={"COURSE_PROFILE": profile},
                         check=False, echo=False)
        logs.append(run.output)
        if run.returncode != 0 or not results_in(run.output):
            rows[name] = {"error": f"exit code {run.returncode}: {run.output.strip()[-400:]}"}
            continue
        r = parse_result(run.output)
        rows[name] = {k: r.get(k) for k in ("world_size", "precision", "tokens_per_s", "tokens_per_s_per_device",
                                            "mfu", "peak_memory_mib", "flops_per_token")} | {
            "loss": r["losses"][-1], "losses": r["losses"]}
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "transformer.log").write_text("\n".join(logs))
    return {"size": size, "seq_len": seq, "batch_per_rank": batch, "layouts": rows}


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



def read_machine(cpu: bool) -> dict[str, Any] | str:
    """The environment report, the label every result carries, and the UUIDs of the GPUs CUDA sees; or the
    line that says why this machine cannot run the check."""
    from course_utils.hardware import environment_report, hardware_label

    env = environment_report()  # the GPU facts from a child process: no CUDA here yet
    if not env["gpus"] and not cpu:
        return ("error: no usable GPU here (torch.cuda.is_available() is False in a fresh process). Run this on a "
                "GPU node, or add --cpu to check the runner itself.")
    device = "cpu" if cpu else "cuda"
    hardware = hardware_label(env, device, ranks=len(env["gpus"])) if device == "cuda" else hardware_label(env, "cpu")
    return {"env": env, "hardware": hardware, "device": device, "gpu_uuids": cuda_uuids() if env["gpus"] else []}


def measure_matmul(device: str, cpu: bool) -> list[dict[str, Any]]:
    """Matmul TFLOP/s per format; CUDA starts in this process here, after every notebook."""
    from course_utils.hardware import matmul_table

    return matmul_table(device, n=512 if cpu else 8192, repeats=3 if cpu else 20)


def flops_per_image(model: str) -> float:
    from course_utils.ladder import train_flops_per_image

    return train_flops_per_image(model)

