#!/usr/bin/env python
"""The first GPU run that counts (`make gpu-check`): every notebook under nbval, the single-device
ladder on ResNet-18, and bf16 matmul TFLOP/s, in one report (Markdown and JSON).

    make gpu-check                                  # on a GPU node, the full profile, in one 25-minute run
    make gpu-check                                  # again: resumes where the last run stopped
    python scripts/gpu_check.py --cpu               # this runner end to end on a CPU (CI tests it)
    python scripts/gpu_check.py --notebooks 01 06   # some notebooks only
    python scripts/gpu_check.py --rerun             # run again what already passed on this hardware

It starts on a machine that has nothing but its own torch: before anything else it says, in one
line, which packages the notebooks need that this Python lacks and the command that carries them
(scripts/gpu_wheels.sh).

A run keeps within --budget-min (25 minutes: a portal session, a debug queue): the notebooks most
likely to fail on a GPU go first (09, 10, 07, 06, 05, then the rest), a notebook starts only when
the time it took here before (or two minutes, the first time) still fits, and the ladder and the
matmul table come once every notebook has a result on this hardware. The report keeps each
notebook's latest result with the hardware and date it ran on, so the next run resumes: it runs
first what has no result here yet, then what failed here, and skips what passed here.

Each notebook runs in its own pytest process (`--nbval-lax`, COURSE_PROFILE as given, nothing
installed by the suite: COURSE_NO_APT=1) with a time limit of its own, so one that hangs costs its
limit and the rest still run. While it runs, NVML samples the memory used on the GPUs this job's
CUDA sees (matched by UUID): the report's peak is the most above what those GPUs held before it
started (its forked and launched ranks included). This process starts CUDA only at the end, for
the matmul measurement, after every notebook has run.

The report: per notebook pass/fail, cells passed, wall time, hardware and date; the ladder in
images/s (the fp32 textbook loop and each optimisation, side by side in one run); measured matmul
TFLOP/s per format; the best rung's training FLOP/s as a share of the bf16 matmul rate; notebook 03's
per-rank traces on the GPU(s), read by course_utils.traces and by Holistic Trace Analysis. Written to
--out (report.md, report.json, one log per notebook).
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
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

# The standard library only, up to main()'s check of what this Python lacks: on a GPU machine with
# nothing but its own torch, course_utils' imports (python-hostlist, for one) would fail first.
REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
NOTEBOOKS = REPO_ROOT / "notebooks"
if str(NOTEBOOKS) not in sys.path:  # course_utils without PYTHONPATH or an install
    sys.path.insert(0, str(NOTEBOOKS))

import gpu_records  # noqa: E402  (the standard library only, like this file up to main's check)

MIN_TORCH = (2, 11)  # the oldest torch the course runs on (README)
TORCH_OWN = {"torch", "torchvision", "torchaudio"}  # the machine's own builds: their dependencies are its business
SITE = "/tmp/course-site"  # where `scripts/gpu_wheels.sh install` puts what was carried
# the notebooks most at risk on a GPU first: 06 and 07 (failed on the H200, fixed since), then those never run
PRIORITY = ("06", "07", "01", "02", "03", "04", "08", "11")
MIN_START_S = 120  # a notebook never timed on this hardware starts only with this much of the budget left
REPORT_S = 30  # kept back at the end of the budget for the report
LADDER_GUESS_S = {"cuda": 360, "cpu": 120}  # the ladder's time before it has been measured on this hardware
TRACES_S = 90  # the per-rank traces: a short training run and its reading
_now = time.monotonic  # the budget's clock (tests drive their own)


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def _requirement_parser():
    """packaging's Requirement (pip's copy where packaging itself is missing), or None."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return None
    return Requirement


def missing_packages(roots: Sequence[str], installed: Mapping[str, Sequence[str]]) -> list[str]:
    """The distributions that ``roots`` (requirement strings) need, directly or through what is installed,
    and ``installed`` (normalised name -> its Requires-Dist lines) lacks. Versions are not compared: the
    machine's own Lightning or matplotlib will do. Without packaging to read markers, only requirements
    without a marker are followed."""
    parser = _requirement_parser()
    missing: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(roots)
    while todo:
        spec = todo.pop()
        if parser is None:
            if ";" in spec:
                continue
            name, extras = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1), frozenset()
        else:
            try:
                req = parser(spec)
            except Exception:  # a malformed line in some package's metadata is not ours to judge
                continue
            name, extras = req.name, frozenset(req.extras)
        key = _norm(name)
        if (key, extras) in seen or key in TORCH_OWN and key in installed:
            continue
        seen.add((key, extras))
        if key not in installed:
            missing.setdefault(key, name)
            continue
        for line in installed[key]:
            if "extra ==" in line and not any(f'"{e}"' in line for e in extras):
                continue  # another extra's (most of what packages list): no parse needed
            if parser is not None:
                try:
                    marker = parser(line).marker
                except Exception:
                    continue
                if marker is not None and not any(marker.evaluate({"extra": e}) for e in (*extras, "")):
                    continue
            elif ";" in line:
                continue
            todo.append(line)
    return sorted(missing.values(), key=str.lower)


def lacking_line(python: str, python_version: tuple[int, ...], torch_version: str | None, missing: Sequence[str],
                 wheels: Mapping[str, str], have: Collection[str] = ()) -> str | None:
    """One line: what this Python lacks for a notebook run and the command that carries it, or None.

    ``wheels``: scripts/gpu_wheels.sh's list (normalised name -> "carried" when its download fetches
    it by default, "there" when only when named: the lent GPU machine's image has it). ``have``: the
    normalised names installed here; the "there" ones it lacks are named too, since what a missing
    package needs cannot be read before it is installed (one carry, not one per layer)."""
    if tuple(python_version[:2]) < (3, 11):
        return (f"error: gpu-check needs Python 3.11 or newer (tomllib); {python} is "
                f"{'.'.join(map(str, python_version[:3]))}: make gpu-check GPU_PYTHON=/path/to/python3.11+")
    if torch_version is None or _version_tuple(torch_version) < MIN_TORCH:
        have = "has no torch" if torch_version is None else f"has torch {torch_version}"
        return (f"error: {python} {have}; gpu-check runs on the machine's own torch "
                f"{'.'.join(map(str, MIN_TORCH))} or newer: make gpu-check GPU_PYTHON=/path/to/the/python/with/it")
    if not missing:
        return None
    named = sorted({_norm(m) for m in missing if wheels.get(_norm(m)) == "there"}
                   | {n for n, where in wheels.items() if where == "there" and n not in have})
    elsewhere = [m for m in missing if _norm(m) not in wheels]
    line = (f"error: {python} (torch {torch_version}) lacks {len(missing)} package(s) the notebooks need: "
            f"{', '.join(missing)}. Carry them: on a machine with a package index, `scripts/gpu_wheels.sh download"
            f"{''.join(' ' + m for m in named)}`; bring each .whl/carry-N folder it makes here and "
            f"run `scripts/gpu_wheels.sh install` after each; then `export PYTHONPATH={SITE}` and `make gpu-check` again")
    if elsewhere:
        line += (f" ({', '.join(elsewhere)}: scripts/gpu_wheels.sh does not carry "
                 f"{'it' if len(elsewhere) == 1 else 'them'}; install from where this Python's torch came from)")
    return line + "."


def what_is_lacking() -> str | None:
    """:func:`lacking_line` for this Python: pyproject's dependencies and test extras, followed through the
    installed packages' metadata; the standard library only, no import of torch."""
    if sys.version_info < (3, 11):
        return lacking_line(sys.executable, tuple(sys.version_info), None, [], {})
    import tomllib
    from importlib.metadata import distributions

    found: dict[str, Any] = {}
    for dist in distributions():  # in sys.path order: the first one found is the one imported
        # the folder's name where it gives one (reading every package's metadata takes a second)
        name = getattr(dist, "_normalized_name", None) or dist.metadata["Name"]
        if name:
            found.setdefault(_norm(name), dist)

    class Installed(dict):  # read a package's requirements only when the walk reaches it
        def __missing__(self, key: str) -> list[str]:
            self[key] = found[key].metadata.get_all("Requires-Dist") or []
            return self[key]

        def __contains__(self, key: object) -> bool:
            return key in found

    installed = Installed()
    versions = {"torch": found["torch"].version} if "torch" in found else {}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    roots = [r for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]
             if _norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) != "torch"]  # torch: its version, below
    wheels = {}
    out = subprocess.run(["bash", str(SCRIPTS / "gpu_wheels.sh"), "needs"], capture_output=True, text=True, timeout=60)
    for line in out.stdout.splitlines():
        pin, where, *_ = line.split() + ["", ""]
        wheels[_norm(pin.split("==")[0])] = where
    return lacking_line(sys.executable, tuple(sys.version_info), versions.get("torch"),
                        missing_packages(roots, installed), wheels, set(found))


def nvml_indices(cuda_uuids: Sequence[str], nvml_uuids: Sequence[str]) -> list[int] | None:
    """Where each GPU this job's CUDA sees is in NVML's list (``nvml_uuids``, NVML's index order), by UUID.

    Not from CUDA_VISIBLE_DEVICES: its numbers are CUDA's, and Slurm's cgroups renumber them (a job
    told "2,3" whose NVML sees its two GPUs as 0 and 1, or told "0,1" on a node whose NVML sees all
    four), and CUDA's order need not be NVML's (CUDA_DEVICE_ORDER). torch writes a UUID bare, NVML
    with "GPU-" before it. None where one has no match (a MIG slice has a UUID of its own): no
    peak is better than another job's GPU.
    """
    def key(uuid: str) -> str:
        uuid = str(uuid).strip().lower()
        return uuid.split("-", 1)[1] if uuid.startswith(("gpu-", "mig-")) else uuid

    where = {key(u): i for i, u in enumerate(nvml_uuids)}
    found = [where.get(key(u)) for u in cuda_uuids]
    return None if not found or None in found else found


class GpuMemorySampler:
    """The peak memory used on this job's GPUs (MiB, summed over GPUs) while a block runs, from NVML.

    NVML sees every process's memory, the ranks a notebook forks or launches included, without
    starting CUDA here. ``gpu_uuids`` are the GPUs CUDA sees (:func:`cuda_uuids`), found in NVML by
    UUID (:func:`nvml_indices`). Where NVML is missing (no NVIDIA driver, no nvidia-ml-py) or a GPU
    is not found in it, ``peak_mib`` is ``None``.
    """

    def __init__(self, gpu_uuids: Sequence[str] = (), interval_s: float = 0.2) -> None:
        self.interval_s, self.peak_mib, self._stop = interval_s, None, threading.Event()
        self._handles: list[Any] = []
        self._nvml = None
        if not gpu_uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            handles, uuids = [], []
            for i in range(pynvml.nvmlDeviceGetCount()):
                try:  # NVML may list GPUs of the node that this job's cgroup does not let it open
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = pynvml.nvmlDeviceGetUUID(handle)
                except pynvml.NVMLError:
                    continue
                handles.append(handle)
                uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)  # bytes from older bindings
        except Exception:
            return
        indices = nvml_indices(gpu_uuids, uuids)
        if indices is not None:
            self._nvml, self._handles = pynvml, [handles[i] for i in indices]

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


def cuda_uuids() -> list[str]:
    """The UUIDs of the GPUs CUDA sees, in CUDA's order, read in a child process (this one starts CUDA
    only at the end); [] where that fails (the report's peaks are then n/a)."""
    from course_utils.paths import child_env

    code = ("import torch; n = torch.cuda.device_count(); "
            "print(' '.join(str(torch.cuda.get_device_properties(i).uuid) for i in range(n)))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(),
                             timeout=120)
    except subprocess.TimeoutExpired:
        return []
    return out.stdout.split() if out.returncode == 0 else []


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
    begin = _now()
    train = run_script("train.py", args, nproc=ranks if ranks > 1 else None, timeout_s=timeout_s, env=env,
                       check=False, echo=False)
    if train.returncode != 0 or not results_in(train.output):
        return {"error": f"train.py: exit code {train.returncode}: {train.output.strip()[-400:]}"}
    read = run_script("trace_analysis.py", [folder], timeout_s=max(60.0, timeout_s - (_now() - begin)), env=env,
                      check=False, echo=False)
    (out / "logs").mkdir(exist_ok=True)
    (out / "logs" / "traces.log").write_text(train.output + read.output)  # the lease brings logs/ back
    if read.returncode != 0 or not results_in(read.output):
        return {"error": f"trace_analysis.py: exit code {read.returncode}: {read.output.strip()[-400:]}"}
    table = read.output[read.output.index("course_utils.traces"):read.output.rindex("RESULT")].rstrip()
    return {**parse_result(read.output), "ranks": ranks, "model": model, "table": table}


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


def _result(n: dict[str, Any]) -> str:
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
             "| notebook | result | cells passed | failed | wall s | peak GPU MiB | hardware | date |",
             "|---|---|---:|---:|---:|---:|---|---|"]
    for n in report["notebooks"]:
        peak = "n/a" if n.get("peak_gpu_mib") is None else f"{n['peak_gpu_mib']:,}"
        lines.append(f"| {n['notebook']} | {_result(n)}{_older(n)} | {n.get('cells_passed', 0)} | {n.get('cells_failed', 0)} "
                     f"| {n.get('seconds', 0.0):.1f} | {peak} | {n.get('hardware') or ''} | {n.get('date') or ''} |")
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


def _here(r: dict[str, Any] | None, hardware: str, profile: str) -> bool:
    """Whether ``r`` is a result (not a notebook left or cut by the budget) from this hardware and profile, of the
    notebook's current code."""
    return (r is not None and r.get("hardware") == hardware and r.get("profile") == profile
            and not r.get("not_run") and not r.get("stopped_by_budget") and not r.get("older_code"))


def plan(names: Sequence[str], latest: Mapping[str, dict[str, Any]], hardware: str, profile: str,
         rerun: bool = False) -> tuple[list[str], list[str]]:
    """The order this run takes ``names`` in, and those it skips as passed here already.

    First what has no result on this hardware yet (a run that stopped is resumed), then what failed
    here; within each, the notebooks most likely to fail on a GPU first (PRIORITY), then by number.
    What passed here is skipped, unless ``rerun``."""
    def rank(name: str) -> tuple[int, str]:
        return (PRIORITY.index(name[:2]) if name[:2] in PRIORITY else len(PRIORITY), name)

    fresh, failed, passed = [], [], []
    for name in sorted(names, key=rank):
        r = latest.get(name)
        (fresh if not _here(r, hardware, profile) else passed if r["passed"] else failed).append(name)
    return (fresh + failed + passed, []) if rerun else (fresh + failed, passed)


def _estimate_s(r: dict[str, Any] | None, hardware: str, profile: str) -> float | None:
    """How long a notebook took on this hardware (at least: a run cut by the budget counts too), or None."""
    if r and r.get("hardware") == hardware and r.get("profile") == profile and not r.get("not_run"):
        return float(r.get("seconds") or 0) or None
    return None


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
                cpu: bool, traces: dict[str, Any] | None = None) -> dict:
    """This run's record for records/gpu (scripts/gpu_records.py): the machine, the commit, each notebook it ran."""
    env = machine["env"]
    measured = "rungs" in ladder and ladder.get("date") == started
    keep = ("notebook", "content", "passed", "cells", "cells_passed", "cells_failed", "seconds", "peak_gpu_mib")
    return {"date": started, "source": " ".join(["scripts/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
            "commit": _commit(), "hardware": machine["hardware"], "gpus": len(env.get("gpus") or []),
            "driver": None if cpu else _driver(), "torch": env.get("torch"), "cuda": env.get("cuda_runtime"),
            "nccl": env.get("nccl"), "cpu": f"{env.get('cpu')}, {env.get('cores_usable')} cores", "profile": profile,
            "notebooks": [{**{k: r.get(k) for k in keep}, "result": _result(r)} for r in results],
            "ladder": ladder if measured else None, "matmul": matmul if measured else [],
            "training_share": share if measured else {},
            "traces": traces if traces and traces.get("date") == started else None,
            **({"matmul_size": "512 x 512, 3 repeats" if cpu else "8192 x 8192, 20 repeats"} if measured else {})}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the ci profile, a small ladder and matmul (proves the runner and the report)")
    p.add_argument("--notebooks", nargs="*", help="notebook numbers, e.g. 00 06 (default: all)")
    p.add_argument("--profile", choices=("ci", "full"), help="COURSE_PROFILE for the notebooks (default: full; "
                                                                "ci with --cpu)")
    p.add_argument("--notebook-timeout", type=int, default=600, help="seconds per notebook (default: 600)")
    p.add_argument("--budget-min", type=float, default=25.0,
                   help="this run, report included, ends within this many minutes (default: 25); what it leaves "
                        "is listed, and the next run resumes there")
    p.add_argument("--rerun", action="store_true",
                   help="run again what already passed on this hardware (notebooks and the ladder)")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "runs" / "gpu-check")
    p.add_argument("--records", type=Path, default=gpu_records.RECORDS,
                   help="the committed records this run resumes from (default: %(default)s); this run's record is "
                        "written to --out, to be copied there")
    args = p.parse_args(argv)
    t0 = _now()
    lacking = what_is_lacking()
    if lacking:
        print(lacking, file=sys.stderr)
        return 2
    notebooks = {path.name: path for path in pick_notebooks(args.notebooks)}
    profile = args.profile or ("ci" if args.cpu else "full")
    machine = read_machine(args.cpu)
    if isinstance(machine, str):
        print(machine, file=sys.stderr)
        return 2
    hardware, device = machine["hardware"], machine["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    previous = load_report(args.out / "report.json")
    latest = {r["notebook"]: r for r in previous.get("notebooks", [])}
    # the committed records of this hardware and profile, where newer than this folder's report
    mine_on_record = [r for r in gpu_records.load_records(args.records)
                      if r["hardware"] == hardware and r["profile"] == profile]
    committed = gpu_records.results_from_records(mine_on_record)
    for name, r in committed.items():
        mine = latest.get(name)
        if mine is None or not _here(mine, hardware, profile) or str(mine.get("date")) < r["date"]:
            latest[name] = r
    content = {name: gpu_records.content_hash(path) for name, path in notebooks.items()}
    for name, r in latest.items():  # a result counts for the code it ran: a notebook's code changed since runs again
        r["older_code"] = name in content and r.get("content") != content[name]
    order, skipped = plan(list(notebooks), latest, hardware, profile, args.rerun)
    started, budget_s = time.strftime("%Y-%m-%d %H:%M"), 60 * args.budget_min
    print(f"gpu-check on {hardware}: {len(order)} notebook(s) to run, profile {profile}, {args.budget_min:g} min",
          flush=True)
    for name in skipped:
        print(f"  {name:38s} passed here on {latest[name].get('date')}: skipped (--rerun runs it again)", flush=True)

    def left_s() -> float:
        return budget_s - REPORT_S - (_now() - t0)

    stamp = {"hardware": hardware, "profile": profile, "date": started, "torch": machine["env"]["torch"]}
    label = f"Executed {started} on {hardware}, profile {profile}, by make gpu-check"  # each executed notebook's
    ran, left = [], []
    model = "cnn" if args.cpu else "resnet18"
    # the latest ladder and matmul table stay in the report, labelled, until this hardware measures its own
    ladder = previous.get("ladder") or {"not_run": "the notebooks come first"}
    matmul, share = previous.get("matmul", []), previous.get("training_share", {})
    traces = previous.get("traces") if (previous.get("traces") or {}).get("hardware") == hardware else None
    if not (ladder.get("hardware") == hardware and ladder.get("profile") == profile and "rungs" in ladder):
        measured = [r for r in mine_on_record if "rungs" in (r.get("ladder") or {})]
        if measured:  # this GPU model's ladder on record: not measured again unless asked
            ladder, matmul, share = measured[-1]["ladder"], measured[-1]["matmul"], measured[-1].get("training_share", {})

    def save() -> dict[str, Any]:
        """The report as it stands, written after every notebook: a run stopped from outside (a lease that
        ends, ^C) leaves what it finished for the next run to resume from."""
        seconds = _now() - t0
        runs = [*previous.get("runs", []), {"started": started, "hardware": hardware, "profile": profile,
                                            "seconds": round(seconds, 1), "ran": ran, "left": left}]
        report = {"hardware": hardware, "started": started, "profile": profile, "torch": machine["env"]["torch"],
                  "environment": machine["env"], "notebooks": [latest[n] for n in sorted(latest)],
                  "ladder_model": ladder.get("model", model), "ladder": ladder, "matmul": matmul,
                  "training_share": share, "traces": traces, "seconds": seconds, "runs": runs}
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / "report.md").write_text(markdown(report))
        return report

    for name in order:
        estimate = _estimate_s(latest.get(name), hardware, profile)
        need = MIN_START_S if estimate is None else 1.2 * estimate
        if left_s() < need:
            left.append(name)
            why = "never timed here" if estimate is None else f"took {estimate:.0f} s here"
            print(f"  {name:38s} left for the next run: {left_s():.0f} s of the budget left, {why}", flush=True)
            continue
        limit = min(args.notebook_timeout, left_s())
        r = {**run_notebook(notebooks[name], profile, limit, limit, logs, machine["gpu_uuids"],
                            executed=args.out / "executed", label=label), **stamp, "content": content[name]}
        ran.append(name)
        if r["timed_out"] and limit < args.notebook_timeout:  # the budget stopped it, not its own limit
            r["stopped_by_budget"] = True
            left.append(name)
        if not r.get("stopped_by_budget") or not _here(latest.get(name), hardware, profile):
            latest[name] = r  # a cut run replaces no result; where there is none, it says how long at least
        peak = "" if r["peak_gpu_mib"] is None else f", peak {r['peak_gpu_mib']:,} MiB on the GPU(s)"
        print(f"  {name:38s} {_result(r)}  {r['cells_passed']} cells, {r['seconds']:.0f} s{peak}", flush=True)
        save()
    for name in left:
        latest.setdefault(name, {"notebook": name, "passed": False, "not_run": True, "timed_out": False,
                                 "cells_passed": 0, "cells_failed": 0, "seconds": 0.0, "peak_gpu_mib": None})

    def ladder_here() -> bool:
        return ladder.get("hardware") == hardware and ladder.get("profile") == profile and "rungs" in ladder

    if not ladder_here() or args.rerun:
        need = 1.2 * float(ladder.get("seconds") or 0) if ladder.get("hardware") == hardware else 0.0
        need, why = need or LADDER_GUESS_S[device], None
        if not all(_here(latest.get(n), hardware, profile) for n in notebooks):
            why = "the notebooks come first; a run after each has a result here measures it"
        elif left_s() < need:
            why = f"{left_s():.0f} s of the budget were left and it takes about {need:.0f} s; the next run measures it"
        else:
            print(f"  ladder ({model}) ...", flush=True)
            ladder_args = (["--batch-size", "32", "--steps", "3", "--untimed-steps", "1", "--workers", "1"]
                           if args.cpu else [])
            begin = _now()
            ladder = run_ladder(model, ladder_args, args.out, min(600, left_s()), profile)
            ladder.update(stamp, seconds=round(_now() - begin, 1), model=model)
            matmul = measure_matmul(device, args.cpu)
            share = training_share(ladder, matmul, flops_per_image(model)) if "error" not in ladder else {}
        if why:
            print(f"  ladder ({model}) not measured on this hardware: {why}", flush=True)
            if "rungs" not in ladder:
                ladder = {"not_run": why}

    traced = traces is not None and "error" not in traces
    if ladder_here() and (not traced or args.rerun):  # after the notebooks and the ladder, as the budget allows
        if left_s() < TRACES_S:
            print(f"  per-rank traces not recorded: {left_s():.0f} s of the budget left; the next run records them",
                  flush=True)
        else:
            print("  per-rank traces (train.py --trace-dir, read by course_utils.traces and HTA) ...", flush=True)
            traces = {**run_traces(args.out, len(machine["env"].get("gpus") or []), args.cpu,
                                   min(300, left_s()), profile), **stamp}
    print(f"\n{markdown(save())}\nwritten: {args.out / 'report.md'} and report.json", flush=True)
    if ran or "rungs" in ladder and ladder.get("date") == started or (traces or {}).get("date") == started:
        record = make_record(started, machine, profile, [latest[n] for n in ran], ladder, matmul, share, argv, args.cpu,
                             traces)
        path = args.out / gpu_records.record_name(started, hardware)
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"this run's record: {path}; commit it: cp {path} {args.records}/ and "
              "python scripts/gpu_records.py --write (the README's and INSTRUCTORS.md's tables)", flush=True)
    todo = [n for n in notebooks if not _here(latest[n], hardware, profile)] + ([] if ladder_here() else ["the ladder"])
    if todo:
        print(f"left for the next run: {', '.join(todo)}; `make gpu-check` again resumes there", flush=True)
    failed = [n for n in notebooks if not latest[n]["passed"]] + (["the ladder"] if "error" in ladder else [])
    return 0 if not todo and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
