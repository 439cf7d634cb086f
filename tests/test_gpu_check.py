"""`make gpu-check`'s runner, end to end on this CPU machine (its --cpu mode): the notebooks run under
nbval in their own processes, the ladder and the matmul table are measured, and the report says
what passed and what failed."""

import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import threading
import time
import types
from pathlib import Path

import nbformat
import pytest

from course_utils.paths import SCRIPTS

sys.path.insert(0, str(SCRIPTS))
import gpu_check  # noqa: E402
import gpu_memory  # noqa: E402
import gpu_packages  # noqa: E402
import gpu_records  # noqa: E402
import gpu_report  # noqa: E402
import gpu_runs  # noqa: E402


def test_the_lease_command_in_its_cpu_mode_brings_back_the_whole_report_and_a_record_in_few_files(tmp_path):
    """scripts/gpu_lease.sh run, as on a lent GPU machine but with --cpu: within its budget (LEASE_MIN, 8.3 minutes
    by default, the command 9), at most 8 files brought back (the device tool's limit), one of them this run's
    record for records/gpu."""
    env = {**os.environ, "OUT": str(tmp_path), "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    run = subprocess.run(["bash", str(SCRIPTS / "gpu_lease.sh"), "run", "--cpu", "--notebooks", "00", "--records",
                          str(tmp_path / "none")], env=env, capture_output=True, text=True, timeout=600)
    brought = sorted(p.name for p in tmp_path.iterdir() if p.is_file())
    assert len(brought) <= 8 and {"report.md", "report.json", "executed.tgz", "logs.tgz"} <= set(brought), \
        (brought, run.stdout[-3000:], run.stderr[-3000:])
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["seconds"] <= 8.3 * 60, "the runner keeps to the lease's budget"
    (record_file,) = [tmp_path / b for b in brought if b.startswith("20")]
    record = json.loads(record_file.read_text())
    assert record["hardware"] == report["hardware"] and record["date"] == report["started"] and record["commit"]
    (entry,) = record["notebooks"]
    assert entry["result"] == "pass" and entry["cells_passed"] == entry["cells"] > 5, entry
    assert entry["content"] == gpu_records.content_hash(SCRIPTS.parent / "notebooks" / "00_environment.ipynb")
    assert record["matmul"] and record["ladder"]["rungs"], "the ladder and the matmul rates, measured in this run"
    with tarfile.open(tmp_path / "executed.tgz") as packed:
        assert "executed/00_environment.ipynb" in packed.getnames()
    (notebook,) = report["notebooks"]
    assert notebook["notebook"] == "00_environment.ipynb" and notebook["passed"] and notebook["cells_passed"] > 5
    ladder = report["ladder"]["rungs"]
    assert ladder[0]["rung"] == "fp32 textbook (defaults)" and ladder[0]["images_per_s"] > 0, \
        "the textbook loop, measured in the same run as the optimisations"
    # the ladder's rule: a rung is kept when it is at least as fast as the best configuration before it
    best, measured = 0.0, [r for r in ladder if not r["status"].startswith("skipped")]
    assert len(measured) >= 3, ladder
    for r in measured:
        assert (r["status"] == "kept") == (r["images_per_s"] >= best), (r, best)
        assert abs(r["speedup"] - r["images_per_s"] / ladder[0]["images_per_s"]) < 1e-9, r
        best = max(best, r["images_per_s"]) if r["status"] == "kept" else best
    assert abs(report["ladder"]["best_speedup"] - best / ladder[0]["images_per_s"]) < 1e-9, "from the measurements"
    assert {r["format"] for r in report["matmul"]} == {"fp32", "bf16"}
    # the best rung's FLOP/s over the fastest format's, from the report's own numbers (not "< 1": on a CPU another
    # process can slow the matmul more than the training, and this test runs beside others)
    share, fastest = report["training_share"], max(report["matmul"], key=lambda r: r["tflops"])
    assert share["rung"] == max((r for r in ladder if r["status"] == "kept"), key=lambda r: r["images_per_s"])["rung"]
    assert share["matmul_format"] == fastest["format"] and share["share"] > 0
    assert abs(share["share"] - share["train_tflops"] / fastest["tflops"]) < 1e-9
    text = (tmp_path / "report.md").read_text()
    assert "| 00_environment.ipynb | ci | pass |" in text and "## Single-device ladder (cnn)" in text
    # notebook 03's per-rank traces, recorded and read as on a GPU machine: here CPU traces, which HTA is not asked
    traces = report["traces"]
    assert traces["ranks"] == 1 and traces["hta_overlap_pct"] is None and "(CPU threads)" in traces["table"], traces
    assert record["traces"] == traces and traces["table"] in text
    # scripts/train_lm.py's throughput: one process here (FSDP2 over the GPUs where there are two or more)
    lm = report["transformer"]
    (one,) = lm["layouts"].values()
    assert one["tokens_per_s"] > 0 and one["mfu"] is None and one["loss"] < 5.6, lm  # no MFU without a GPU's peak
    assert record["transformer"] == lm and "## The transformer (scripts/train_lm.py)" in text
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]


def test_a_notebook_cut_short_is_labelled_with_where_it_stopped():
    """The executed copy is rewritten after each cell: one that a kill or gpu-check's time limit cut short keeps
    the label of its last cell, which says the cells below it did not run (make site shows that label)."""
    from record_executed import run_label

    assert run_label("Executed on H200", 0, 11, 30) == \
        "Executed on H200; stopped after code cell 11 of 30: the cells below it did not run"
    assert run_label("Executed on H200", 1, 30, 30) == "Executed on H200; 1 cell(s) raised"


def test_a_failing_notebook_is_reported_as_failed_and_the_run_goes_on(tmp_path):
    # the first cell also checks that the suite's conftest is told to install nothing (no apt-get on a GPU node)
    # the second forks a process that crashes, as a rank forked by Lightning's ddp_notebook did on the H200
    crash = ("import ctypes, os, time\nprint('computed', flush=True)\nif os.fork() == 0:\n    ctypes.string_at(0)\n"
             "os.wait(); time.sleep(1)")
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("import os; assert os.environ['COURSE_NO_APT']"),
                                         nbformat.v4.new_code_cell(crash),
                                         nbformat.v4.new_code_cell("assert 1 + 1 == 3, 'the lesson is wrong'")])
    path = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, path)
    result = gpu_runs.run_notebook(path, "ci", 300, 60, tmp_path, executed=tmp_path / "executed", label="Executed here")
    assert not result["passed"] and result["cells_passed"] == 2 and result["cells_failed"] == 1
    assert "the lesson is wrong" in (tmp_path / "99_broken.log").read_text()
    # the notebook with what each cell showed, for make site and for whoever reads why it failed
    executed = nbformat.read(tmp_path / "executed" / "99_broken.ipynb", as_version=4)
    nbformat.validate(executed)
    shown = ["".join(o.get("text", "") for o in c.outputs) for c in executed.cells]
    assert "computed" in shown[1]
    crashed = (tmp_path / "99_broken.stderr.log").read_text()
    assert "Segmentation fault" in crashed and "line 4" in crashed, "the forked child's crash says where (nbval " \
        "sends a kernel's stderr to /dev/null)"
    assert [o.output_type for o in executed.cells[2].outputs] == ["error"]
    assert executed.metadata["course_run"]["label"] == "Executed here; 1 cell(s) raised"
    assert (executed.metadata["course_run"]["cells_ran"], executed.metadata["course_run"]["cells"]) == (3, 3)
    skipped = {**result, "notebook": "98_late.ipynb", "not_run": True, "cells_passed": 0, "cells_failed": 0}
    text = gpu_report.markdown({
        "hardware": "x", "started": "now", "profile": "ci", "torch": "t", "seconds": 1.0,
        "notebooks": [{**result, "profile": "ci"}, {**skipped, "profile": "full"}],
        "ladder_model": "cnn", "ladder": {"error": "not run"}, "matmul": [], "training_share": {}})
    assert "| 99_broken.ipynb | ci | FAIL | 2 | 1 |" in text and "| 98_late.ipynb | full | not run (budget) |" in text


# ---- a bare GPU machine: only torch (and numpy) installed ------------------------------------------

def _bare_site(tmp_path):
    """A folder holding torch, what torch itself requires, and numpy, linked from this environment: what a GPU
    machine with nothing but its own torch has."""
    from importlib.metadata import distribution

    from packaging.requirements import Requirement

    site, todo, seen = tmp_path / "site", ["torch", "numpy"], set()
    site.mkdir()
    while todo:
        name = todo.pop()
        try:
            dist = distribution(name)
        except Exception:
            continue
        if dist.metadata["Name"].lower() in seen:
            continue
        seen.add(dist.metadata["Name"].lower())
        root = Path(dist.locate_file(""))
        for top in {f.parts[0] for f in dist.files or [] if f.parts[0] != ".."}:
            if (root / top).exists() and not (site / top).exists():
                (site / top).symlink_to(root / top)
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append(req.name)
    return site


def test_a_machine_with_only_torch_is_told_in_one_line_what_it_lacks_and_how_to_carry_it(tmp_path):
    """Issue 31, finding 8: the runner died importing hostlist before it said what was missing."""
    site = _bare_site(tmp_path)
    out = subprocess.run([sys.executable, "-S", str(SCRIPTS / "gpu_check.py"), "--cpu", "--out", str(tmp_path / "o")],
                         env={"PATH": os.environ["PATH"], "PYTHONPATH": f"{SCRIPTS.parent / 'notebooks'}:{site}"},
                         capture_output=True, text=True, timeout=60)  # the notebooks on PYTHONPATH, as make does
    lines = [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]
    assert out.returncode == 2 and len(lines) == 1, out.stdout + out.stderr
    (line,) = lines
    for name in ("python-hostlist", "nbval", "deepspeed", "ray", "optuna", "lightning", "matplotlib", "pytest"):
        assert re.search(rf"[:,] {name}[,.]", line, re.I), (name, line)
    assert "numpy" not in line and "torch " in line, "what it has is not asked for"
    # what the lent machine's image lacks is carried by default; what it has is named to be carried too
    assert re.search(r"`scripts/gpu_wheels.sh download [^`]*\bmatplotlib\b[^`]*`", line), line
    assert "`scripts/gpu_wheels.sh install`" in line and "export PYTHONPATH=/tmp/course-site" in line
    assert not (tmp_path / "o").exists(), "it stops before anything runs"


def test_what_is_missing_is_followed_through_installed_metadata_extras_included():
    installed = {"lightning": ["torch>=2.1", "pyyaml", "sphinx; extra == \"docs\""], "torch": ["nvidia-cublas"],
                 "ray": ["click", "tensorboardx; extra == \"tune\"", "pandas; extra == \"tune\"",
                         "colorama; sys_platform == \"win32\""], "pandas": ["tzdata"]}
    missing = gpu_packages.missing_packages(["lightning==2.6.6", "ray[tune]==2.60.0", "nbval"], installed)
    assert missing == ["click", "nbval", "pyyaml", "tensorboardx", "tzdata"], \
        "not another extra's (sphinx), not another platform's (colorama), not torch's own (nvidia-cublas)"
    wheels = {"click": "there", "nbval": "carried", "tensorboardx": "carried", "six": "there", "numpy": "there"}
    line = gpu_packages.lacking_line("/usr/bin/python3", (3, 12, 3), "2.11.0+cu130", missing, wheels, {"numpy", "ray"})
    assert "`scripts/gpu_wheels.sh download click six`" in line, "six: what a missing package may need, the " \
        "lent machine's image has and this one lacks"
    assert "pyyaml, tzdata: scripts/gpu_wheels.sh does not" in line
    old = gpu_packages.lacking_line("/usr/bin/python3", (3, 12, 3), "2.9.1", [], {})
    assert "torch 2.9.1" in old and "2.11 or newer" in old and "GPU_PYTHON=" in old
    assert gpu_packages.lacking_line("/x/python3", (3, 11, 7), "2.14.1", [], {}) is None


def test_the_wheels_cover_what_the_lent_machine_lacks_and_carry_what_is_named(tmp_path):
    listed = subprocess.run(["bash", str(SCRIPTS / "gpu_wheels.sh"), "needs"], capture_output=True, text=True,
                            check=True).stdout
    where = {norm: w for _, w, norm in (line.split() for line in listed.splitlines())}
    assert where["python-hostlist"] == where["nbval"] == where["deepspeed"] == "carried"
    assert where["tensorboardx"] == "carried", "the lent image has tensorboard, not tensorboardX (ray[tune] needs it)"
    assert where["pexpect"] == where["ptyprocess"] == "carried", "IPython needs them on Linux (the H200 run stopped there)"
    assert where["matplotlib"] == where["nvidia-ml-py"] == "there"
    assert not {"torch", "torchvision", "triton", "nvidia-cublas", "jupyterlab"} & set(where), "torch's own, the lab's"
    # download NAME: carried besides the default set (a stand-in for pip records what is asked for)
    (tmp_path / "scripts").mkdir()
    shutil.copy(SCRIPTS / "gpu_wheels.sh", tmp_path / "scripts")
    shutil.copy(SCRIPTS.parent / "constraints.txt", tmp_path)
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "python3").write_text('#!/bin/sh\necho "$@" >> "$ASKED"\nfor a; do d=$prev; prev=$a; done\n'
                                  'spec=$a; w="$d/${spec%%==*}-${spec##*==}-py3-none-any.whl"; echo zip > "$w"\n'
                                  'case $spec in ray==*) truncate -s 79M "$w";; deepspeed==*) truncate -s 50M "$w";;'
                                  ' esac\n')  # Ray's wheel is 79 MB; with what a bare machine lacks, more than 120
    (bin_ / "python3").chmod(0o755)
    asked = tmp_path / "asked"
    subprocess.run(["bash", str(tmp_path / "scripts" / "gpu_wheels.sh"), "download", "Matplotlib"], check=True,
                   env={**os.environ, "PATH": f"{bin_}:{os.environ['PATH']}", "ASKED": str(asked)}, capture_output=True)
    fetched = {line.split()[-1].split("==")[0].lower() for line in asked.read_text().splitlines()}
    assert {"python-hostlist", "deepspeed", "matplotlib"} <= fetched and "pandas" not in fetched, fetched
    carries = sorted((tmp_path / ".whl").iterdir())
    assert [c.name for c in carries] == ["carry-1", "carry-2", "carry-3"], "as many calls as it takes"
    assert all(sum(f.stat().st_size for f in c.iterdir()) <= 60 * 2**20 for c in carries), "64 MiB a call, repo too"


# ---- NVML: the job's GPUs by UUID ---------------------------------------------------------------------

A, B, C, D = (f"{c * 8}-1111-2222-3333-444455556666" for c in "abcd")


def test_nvml_finds_the_jobs_gpus_by_uuid_not_by_cuda_visible_devices():
    # told "2,3", the job's cgroup shows NVML only its two GPUs, as 0 and 1 (here in the other order)
    assert gpu_memory.nvml_indices([C, D], [f"GPU-{D}", f"GPU-{C}"]) == [1, 0]
    # told "0,1" (Slurm renumbered), NVML sees the node's four GPUs: the job's are its 2 and 3
    assert gpu_memory.nvml_indices([C, D], [f"GPU-{u}" for u in (A, B, C, D)]) == [2, 3]
    assert gpu_memory.nvml_indices([C.upper()], [f"GPU-{C}"]) == [0], "torch writes it bare, NVML with GPU-"
    assert gpu_memory.nvml_indices([f"MIG-{A}"], [f"GPU-{B}"]) is None, "no match: no peak rather than a wrong one"
    assert gpu_memory.nvml_indices([], [f"GPU-{A}"]) is None


def test_the_sampler_measures_the_gpus_the_job_was_given(monkeypatch):
    """CUDA_VISIBLE_DEVICES=2,3 where NVML sees two GPUs: taking NVML's 2 and 3 found none (or others' GPUs)."""
    used = {f"GPU-{C}": 5 * 2**20, f"GPU-{D}": 7 * 2**20}

    class FakeNvml:
        NVMLError = RuntimeError
        nvmlInit = staticmethod(lambda: None)
        nvmlDeviceGetCount = staticmethod(lambda: 2)
        nvmlDeviceGetUUID = staticmethod(lambda h: h.encode())  # older bindings return bytes

        @staticmethod
        def nvmlDeviceGetHandleByIndex(i):
            return [f"GPU-{D}", f"GPU-{C}"][i]  # raises IndexError for 2 and 3, as NVML would refuse them

        @staticmethod
        def nvmlDeviceGetMemoryInfo(h):
            return types.SimpleNamespace(used=used[h])

    monkeypatch.setitem(sys.modules, "pynvml", FakeNvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    sampler = gpu_memory.GpuMemorySampler([C], interval_s=0.01)
    assert sampler._handles == [f"GPU-{C}"]
    with sampler:
        used[f"GPU-{C}"] += 3 * 2**20
        time.sleep(0.05)
    assert sampler.peak_mib == 3, "what this job's GPU gained, not the other's"


# ---- 25-minute runs that resume ---------------------------------------------------------------------

def _fake_machine(monkeypatch, tmp_path, hardware, minutes, fails=(), stop_at=None, side_by_side=None):
    """main() with notebooks that take ``minutes[name]`` (1 in the ci profile) of a clock of the test's own: what ran,
    in order (the ci pass's as "ci NN"); ``side_by_side`` collects how many ran at once."""
    names = [f"{i:02d}_n.ipynb" for i in range(11)]
    (tmp_path / "nb").mkdir(exist_ok=True)
    for name in names:
        (tmp_path / "nb" / name).touch()
    clock, ran, lock, running = [0.0], [], threading.Lock(), [0]

    def run_notebook(path, profile, timeout_s, cell_timeout_s, logs, gpu_uuids=(), executed=None, label=""):
        if path.name[:2] == stop_at:
            raise KeyboardInterrupt  # ^C, or the GPU's lease ending
        took = 60 * (1 if profile == "ci" else minutes.get(path.name[:2], 4))
        with lock:
            running[0] += 1
            clock[0] += min(took, timeout_s)
            ran.append(("ci " if profile == "ci" else "") + path.name[:2])
        if side_by_side is not None:
            time.sleep(0.2)
            side_by_side.append(running[0])
        with lock:
            running[0] -= 1
        passed = path.name[:2] not in fails and took <= timeout_s
        return {"notebook": path.name, "passed": passed, "timed_out": took > timeout_s, "cells_passed": 3,
                "cells_failed": 0 if passed else 1, "seconds": min(took, timeout_s),
                "peak_gpu_mib": 100 if gpu_uuids else None, "log": ""}

    def run_ladder(model, args, out, timeout_s, profile):
        clock[0] += 200
        ran.append("ladder")
        return {"rungs": [], "best_speedup": 1.0}

    monkeypatch.setattr(gpu_check, "NOTEBOOKS", tmp_path / "nb")
    monkeypatch.setattr(gpu_check, "_now", lambda: clock[0])
    monkeypatch.setattr(gpu_check, "what_is_lacking", lambda: None)
    monkeypatch.setattr(gpu_check, "read_machine", lambda cpu: {
        "env": {"torch": "2.11.0"}, "hardware": hardware, "device": "cuda", "gpu_uuids": [A]})
    monkeypatch.setattr(gpu_check, "run_notebook", run_notebook)
    monkeypatch.setattr(gpu_check, "run_ladder", run_ladder)
    monkeypatch.setattr(gpu_check, "measure_matmul", lambda device, cpu: [{"format": "bf16", "tflops": 700.0,
                                                                          "vs_fp32": 10.0}])
    monkeypatch.setattr(gpu_check, "flops_per_image", lambda model: 1e9)
    monkeypatch.setattr(gpu_check, "run_traces", lambda out, gpus, cpu, timeout_s, profile: {  # the lease test's
        "ranks": 1, "model": "resnet18", "table": "(traces)", "hta_overlap_pct": None})
    return ran


def clock_of(ran):
    return 240 * sum(n != "ladder" for n in ran) + 200 * ran.count("ladder")


def test_a_run_keeps_to_its_budget_and_the_next_resumes_it(tmp_path, monkeypatch, capsys):
    out = ["--out", str(tmp_path / "report"), "--records", str(tmp_path / "no-records"), "--profile", "full"]
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {}, fails={"09"})
    assert gpu_check.main(out) == 1
    assert ran == ["01", "02", "04", "08", "06", "07"], "the notebooks most at risk first"
    assert clock_of(ran) <= 25 * 60 - gpu_check.REPORT_S, "all within the 25 minutes"
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    by_name = {r["notebook"][:2]: r for r in report["notebooks"]}
    assert by_name["06"]["hardware"] == "1 x H100" and by_name["06"]["date"] and by_name["06"]["passed"]
    assert by_name["03"]["not_run"] and by_name["03"]["profile"] == "full" and "not_run" in report["ladder"]
    assert "left for the next run: 00_n.ipynb (full), 03_n.ipynb (full), 05_n.ipynb (full)" in capsys.readouterr().out

    ran.clear()
    assert gpu_check.main(out) == 1
    assert ran == ["00", "03", "05", "09", "10"], "resumed where it stopped, by number; what passed is not " \
        "run again; the ladder's 360 s did not fit in the 270 left"
    ran.clear()
    assert gpu_check.main(out) == 1
    assert ran == ["09", "ladder"], "then what failed here; the ladder once every notebook has a result"
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert len(report["runs"]) == 3 and report["ladder"]["hardware"] == "1 x H100"
    assert "| 10_n.ipynb | full | pass | 3 | 0 | 240.0 | 100 | 1 x H100 |" in (tmp_path / "report" / "report.md").read_text()

    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {})  # 09 fixed
    assert gpu_check.main(out) == 0 and ran == ["09"]
    ran.clear()
    assert gpu_check.main(out + ["--rerun", "--notebooks", "06"]) == 0 and ran == ["06", "ladder"], "asked"
    ran = _fake_machine(monkeypatch, tmp_path, "2 x A100", {})
    gpu_check.main(out + ["--notebooks", "00"])
    assert ran == ["00", "ladder"], "another machine's passes do not count here"


def test_a_gpu_run_checks_every_notebook_in_the_ci_profile_first_then_resumes_the_full_profile(tmp_path,
                                                                                              monkeypatch):
    """On a GPU, by default: every notebook in the ci profile (--jobs side by side; no peak memory then, the GPU
    is shared), then the full profile in the budget left. The record and the tables carry each result's profile;
    the next run skips the ci pass that passed and goes on with the full profile."""
    out = ["--out", str(tmp_path / "report"), "--records", str(tmp_path / "records"), "--jobs", "3"]
    (tmp_path / "records").mkdir()
    at_once = []
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {}, side_by_side=at_once)
    assert gpu_check.main(out) == 1
    assert sorted(ran[:11]) == [f"ci {i:02d}" for i in range(11)] and max(at_once) == 3, (ran, at_once)
    assert ran[11:] == ["01", "02", "04"], "11 minutes of ci, then three full ones in the 13.5 left"
    (written,) = (tmp_path / "report").glob("20*.json")
    record = json.loads(written.read_text())
    profiles = [(n["profile"], n["notebook"][:2], n["peak_gpu_mib"]) for n in record["notebooks"]]
    assert profiles[11:] == [("full", "01", 100), ("full", "02", 100), ("full", "04", 100)]
    assert {p for p, _, _ in profiles[:11]} == {"ci"} and {m for _, _, m in profiles[:11]} == {None}
    assert record["profile"] == "ci, full" and record["ladder"] is None
    table = gpu_records.latest_table([{**record, "file": written.name}], tmp_path / "nb")
    assert table.splitlines()[0] == "| notebook | 1 x H100, `ci` | 1 x H100, `full` |"
    assert table.splitlines()[3].startswith("| 01 | pass, 3 cells, ") and table.splitlines()[5].endswith("| not run |")
    shutil.copy(written, tmp_path / "records" / written.name)

    ran.clear()
    assert gpu_check.main(out) == 1
    assert ran == ["08", "06", "07", "00", "03", "05"], "the ci pass passed on this code: only the full profile"


def test_a_notebook_cut_by_the_budget_is_not_a_failure_and_goes_first_next_time(tmp_path, monkeypatch):
    out = ["--out", str(tmp_path / "report"), "--records", str(tmp_path / "no-records"), "--profile", "full"]
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {"01": 9, "02": 9, "04": 9})
    assert gpu_check.main(out) == 1 and ran == ["01", "02", "04"]
    cut = {r["notebook"][:2]: r for r in json.loads((tmp_path / "report" / "report.json").read_text())["notebooks"]}
    assert cut["04"]["stopped_by_budget"] and not cut["04"]["passed"] and cut["04"]["seconds"] < 9 * 60
    assert "| 04_n.ipynb | full | stopped (budget) |" in (tmp_path / "report" / "report.md").read_text()
    ran.clear()
    gpu_check.main(out)
    assert ran[0] == "04"


# ---- the suite installs nothing where it cannot, and says why -------------------------------------------

def _root_conftest():
    spec = importlib.util.spec_from_file_location("root_conftest_for_gpu_check", SCRIPTS.parent / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test cluster is Linux-only")
def test_under_gpu_check_the_suite_tries_no_apt_get_and_says_why(monkeypatch):
    conftest = _root_conftest()
    cluster = conftest._slurm_cluster_module()
    lines, absent = [], {"slurmctld", "slurmd", "sbatch", "shellcheck"}

    def no_apt(*a, **k):
        raise AssertionError(f"ran {a}")

    reporter = types.SimpleNamespace(write_line=lines.append)
    session = types.SimpleNamespace(config=types.SimpleNamespace(
        pluginmanager=types.SimpleNamespace(get_plugin=lambda name: reporter)))
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool in absent else f"/usr/bin/{tool}")
    monkeypatch.setattr(cluster.subprocess, "run", no_apt)
    monkeypatch.setenv("COURSE_NO_APT", "1")
    conftest.pytest_sessionstart(session)
    assert len(lines) == 1 and "COURSE_NO_APT" in lines[0] and "apt-get install slurm-wlm shellcheck" in lines[0]
    assert "COURSE_NO_APT" in cluster.unavailable_reason(), "the Slurm tests skip with the reason"
    absent = {"shellcheck"}  # Slurm there, shellcheck not
    lines.clear()
    conftest.pytest_sessionstart(session)
    assert cluster.unavailable_reason() is None and len(lines) == 1 and "shellcheck not installed" in lines[0]


@pytest.mark.skipif(sys.platform != "linux", reason="the Slurm test cluster is Linux-only")
def test_without_a_reachable_mirror_apt_get_is_not_tried(tmp_path, monkeypatch):
    cluster = _root_conftest()._slurm_cluster_module()
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()  # nothing listens there: refused at once
    (tmp_path / "sources.list.d").mkdir()
    (tmp_path / "sources.list").write_text(f"# a comment\ndeb [arch=amd64] http://127.0.0.1:{port}/debian bookworm"
                                           " main\n")
    assert cluster._apt_targets(tmp_path, "", {}) == [("127.0.0.1", port)]
    monkeypatch.setattr(cluster, "APT_DIR", tmp_path)
    monkeypatch.setattr(cluster, "_apt_config", lambda: "")
    for var in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY", "COURSE_NO_APT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(cluster.os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool in ("slurmctld", "slurmd", "sbatch")
                        else f"/usr/bin/{tool}")
    reason = cluster.unavailable_reason()
    assert reason and f"127.0.0.1:{port}" in reason and "cannot reach" in reason
    # a source that answers (deb822 format), or a proxy that does: apt-get goes ahead as before
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        live = server.getsockname()[1]
        (tmp_path / "sources.list").unlink()
        (tmp_path / "sources.list.d" / "debian.sources").write_text(
            f"Types: deb\nURIs: http://127.0.0.1:{live}/debian\nSuites: bookworm\n\n"
            f"Types: deb\nURIs: http://127.0.0.1:{port}/off\nEnabled: no\n")
        assert cluster._apt_targets(tmp_path, "", {}) == [("127.0.0.1", live)]
        assert cluster._apt_unreachable_uncached(str(tmp_path)) is None
        proxied = cluster._apt_targets(tmp_path, f'Acquire::http::Proxy "http://127.0.0.1:{live}";\n', {})
        assert proxied == [("127.0.0.1", live)]


def test_a_run_stopped_from_outside_keeps_what_it_finished(tmp_path, monkeypatch):
    out = ["--out", str(tmp_path / "report"), "--records", str(tmp_path / "no-records"), "--profile", "full"]
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {}, stop_at="07")
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(out)
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {})
    gpu_check.main(out)
    assert ran[:2] == ["07", "00"], "06 passed before the stop and is kept"



# ---- the committed records: what a lease resumes from, and the tables made from them --------------------------

def test_a_run_resumes_from_the_committed_records_and_its_own_record_resumes_the_next(tmp_path, monkeypatch):
    """A lent machine starts bare: what it resumes from is records/gpu. Passed on this GPU model for the notebook's
    current code: skipped. Stopped by the budget, run on another model, or of older code: run first (the most at
    risk first), then what failed here. The run's own record, committed, makes the next run skip what it passed."""
    ran = _fake_machine(monkeypatch, tmp_path, "1 x H100", {}, fails={"05"})
    records = tmp_path / "records"
    records.mkdir()
    now = gpu_records.content_hash(tmp_path / "nb" / "00_n.ipynb")  # every fake notebook is the same empty file

    def entry(n, result, content=now):
        return {"notebook": f"{n}_n.ipynb", "content": content, "result": result, "passed": result == "pass",
                "cells": 3, "cells_passed": 3, "seconds": 60.0, "peak_gpu_mib": 10}

    base = {"commit": "abc1234", "gpus": 1, "driver": "580", "torch": "2.11", "profile": "full", "ladder": None,
            "matmul": []}
    (records / "2026-11-26-h100.json").write_text(json.dumps({**base, "date": "2026-11-26 01:00", "hardware": "1 x H100",
        "notebooks": [entry("00", "pass"), entry("01", "FAIL"), entry("02", "pass", "0" * 12), entry("03", "pass"),
                      entry("06", "stopped (budget)"), entry("10", "pass")]}))
    (records / "2026-11-26-h200.json").write_text(json.dumps({**base, "date": "2026-11-26 02:00", "hardware": "1 x H200",
        "notebooks": [entry("04", "pass")]}))
    out = ["--out", str(tmp_path / "report"), "--records", str(records), "--budget-min", "60", "--profile", "full"]
    assert gpu_check.main(out) == 1
    assert ran == ["04", "08", "06", "07", "05", "09", "01", "02", "ladder"], \
        "no finished result here first (most at risk first, then by number), then what failed, then older code"
    report = json.loads((tmp_path / "report" / "report.json").read_text())
    assert {r["notebook"][:2]: r.get("from_record") for r in report["notebooks"]}["00"] == "2026-11-26-h100.json"

    (written,) = (tmp_path / "report").glob("20*.json")
    record = json.loads(written.read_text())
    assert [n["notebook"][:2] for n in record["notebooks"]] == ran[:-1] and record["hardware"] == "1 x H100"
    assert {n["result"] for n in record["notebooks"]} == {"pass", "FAIL"} and all(n["content"] == now
                                                                                  for n in record["notebooks"])
    assert record["ladder"] is not None and record["matmul"], "measured in this run: in its record"
    shutil.copy(written, records / "2026-11-27-h100.json")
    ran.clear()
    assert gpu_check.main(["--out", str(tmp_path / "fresh"), "--records", str(records), "--profile", "full"]) == 1
    assert ran == ["05"], "a fresh machine, the records committed: only what failed runs again"


def test_the_contributing_and_instructors_tables_are_the_records():
    """The GPU tables in CONTRIBUTING.md and INSTRUCTORS.md are what scripts/gpu_records.py makes of records/gpu."""
    records = gpu_records.load_records()
    assert any(r.get("transcribed") and r["date"].startswith("2026-11-26") for r in records), "the H200 run is in"
    for doc, block in gpu_records.blocks(records).items():
        text = (SCRIPTS.parent / doc).read_text()
        assert f"{gpu_records.START}\n{block}\n{gpu_records.END}" in text, \
            f"{doc}'s GPU table is not the records': python scripts/gpu_records.py --write"
    for r in records:
        assert r["file"] == gpu_records.record_name(r["date"], r["hardware"]), r["file"]
        for n in r["notebooks"]:
            assert n["result"] in ("pass", "FAIL", "timed out", "stopped (budget)") and n["passed"] == (
                n["result"] == "pass") and len(n["content"]) == 12, (r["file"], n)


def test_a_notebook_s_content_is_its_code_not_its_prose(tmp_path):
    import nbformat

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("the idea"), nbformat.v4.new_code_cell("x = 1")])
    path = tmp_path / "n.ipynb"
    nbformat.write(nb, path)
    first = gpu_records.content_hash(path)
    nb.cells[0].source = "the idea, in fewer words"
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", text="1")]
    nbformat.write(nb, path)
    assert gpu_records.content_hash(path) == first, "prose and outputs do not ask for a new GPU run"
    nb.cells[1].source = "x = 2"
    nbformat.write(nb, path)
    assert gpu_records.content_hash(path) != first, "a changed line of code does"
