#!/usr/bin/env python
"""The first GPU run that counts (`make gpu-check`): every notebook under nbval, the single-device
ladder on ResNet-18, and bf16 matmul TFLOP/s, in one report (Markdown and JSON).

    make gpu-check                                  # on a GPU node: the ci pass, then the full profile
    make gpu-check                                  # again: resumes where the last run stopped
    python scripts/gpu_check.py --cpu               # this runner end to end on a CPU (CI tests it)
    python scripts/gpu_check.py --notebooks 01 06   # some notebooks only
    python scripts/gpu_check.py --profile full      # the full profile only
    python scripts/gpu_check.py --rerun             # run again what already passed on this hardware

It starts on a machine that has nothing but its own torch: before anything else it says, in one
line, which packages the notebooks need that this Python lacks and the command that carries them
(gpu_packages.py, scripts/gpu_wheels.sh).

Two passes on a GPU, each resumed from the records (gpu_plan.py): first every notebook in the CI profile,
--jobs at a time (the CUDA path of each on one device: the device policy, autocast and GradScaler by compute
capability, compile, pinned memory, the profiler, Lightning, DeepSpeed, Ray on a GPU), then the full profile,
one at a time. A notebook starts only when the time it took here before (or two minutes, the first time) still
fits the budget (--budget-min); the ladder, the matmul table and notebook 03's per-rank traces come once every
notebook has a full-profile result here. The report keeps each notebook's latest result per profile with the
hardware and date it ran on, so the next run resumes.

Each notebook runs in its own pytest process (gpu_runs.py: `--nbval-lax`, nothing installed by the suite,
COURSE_NO_APT=1) with a time limit of its own, so one that hangs costs its limit and the rest still run. One at
a time, NVML samples the memory used on the GPUs this job's CUDA sees (gpu_memory.py); notebooks run side by side
share the GPU, so their peaks are not recorded. This process starts CUDA only at the end, for the matmul rates.

The report (gpu_report.py): per notebook and profile pass/fail, cells passed, wall time, hardware and date; the
ladder in images/s; matmul TFLOP/s per format; the best rung's training FLOP/s as a share of the bf16 matmul rate;
notebook 03's per-rank traces. Written to --out (report.md, report.json, one log per notebook, this run's record).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

# The standard library only, up to main()'s check of what this Python lacks: on a GPU machine with
# nothing but its own torch, course_utils' imports (python-hostlist, for one) would fail first.
REPO_ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = REPO_ROOT / "notebooks"
if str(NOTEBOOKS) not in sys.path:  # course_utils without PYTHONPATH or an install
    sys.path.insert(0, str(NOTEBOOKS))

# noqa: E402 below: each module, like this file up to main's check, imports the standard library only at its top
import gpu_records  # noqa: E402
from gpu_packages import what_is_lacking  # noqa: E402
from gpu_plan import current_here, estimate_s, need_s, pick_notebooks, plan, ran_here  # noqa: E402
from gpu_report import load_report, make_record, markdown, result_words  # noqa: E402
from gpu_runs import (flops_per_image, measure_matmul, read_machine, run_ladder, run_notebook,  # noqa: E402
                      run_traces, training_share)

REPORT_S = 30  # kept back at the end of the budget for the report
LADDER_GUESS_S = {"cuda": 360, "cpu": 120}  # the ladder's time before it has been measured on this hardware
TRACES_S = 90  # the per-rank traces: a short training run and its reading
_now = time.monotonic  # the budget's clock (tests drive their own)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cpu", action="store_true",
                   help="no GPU: the ci profile, a small ladder and matmul (proves the runner and the report)")
    p.add_argument("--notebooks", nargs="*", help="notebook numbers, e.g. 00 06 (default: all)")
    p.add_argument("--profile", choices=("ci", "full"),
                   help="one profile only (default: the ci pass, then the full profile; ci with --cpu)")
    p.add_argument("--jobs", type=int, help="notebooks run side by side in the ci pass (default: one per 5 cores, "
                                            "at most 3; 1 with --cpu); the full profile runs one at a time")
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
    return p.parse_args(argv)


def resume(previous: dict[str, Any], on_record: list[dict[str, Any]], hardware: str, profiles: list[str],
           content: dict[str, str]) -> dict[str, dict[str, dict[str, Any]]]:
    """Each profile's latest result per notebook: this folder's report, or the committed records where newer; each
    marked ``older_code`` where the notebook's code has changed since it ran."""
    latest: dict[str, dict[str, dict[str, Any]]] = {p: {} for p in profiles}
    for r in previous.get("notebooks", []):
        latest.setdefault(r.get("profile") or "full", {})[r["notebook"]] = r
    for profile, results in latest.items():
        for name, r in gpu_records.results_from_records(on_record, profile).items():
            mine = results.get(name)
            if mine is None or not ran_here(mine, hardware, profile) or str(mine.get("date")) < r["date"]:
                results[name] = r
        for name, r in results.items():  # a result counts for the code it ran
            r["older_code"] = name in content and r.get("content") != content[name]
    return latest


def run_in_turn(order: list[str], jobs: int, need_s: Any, left_s: Any, start: Any, done: Any, skip: Any) -> None:
    """Start each of ``order``, ``jobs`` at a time, while the budget still has ``need_s(name)`` seconds left
    (``skip(name)`` where not); ``done(name, result)`` in this thread as each ends."""
    pending, running = list(order), {}
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        while pending or running:
            while pending and len(running) < jobs:
                name = pending.pop(0)
                if left_s() < need_s(name):
                    skip(name)
                else:
                    running[pool.submit(start, name)] = name
            if running:
                finished, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in finished:
                    done(running.pop(future), future.result())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = _now()
    lacking = what_is_lacking()
    if lacking:
        print(lacking, file=sys.stderr)
        return 2
    notebooks = {path.name: path for path in pick_notebooks(NOTEBOOKS, args.notebooks)}
    passes = [args.profile] if args.profile else (["ci"] if args.cpu else ["ci", "full"])
    main_profile = passes[-1]  # the ladder's and the traces'
    jobs = {"ci": max(1, args.jobs or (1 if args.cpu else min(3, (os.cpu_count() or 1) // 5))), "full": 1}
    machine = read_machine(args.cpu)
    if isinstance(machine, str):
        print(machine, file=sys.stderr)
        return 2
    hardware, device = machine["hardware"], machine["device"]
    args.out.mkdir(parents=True, exist_ok=True)
    logs = args.out / "logs"
    logs.mkdir(exist_ok=True)
    previous = load_report(args.out / "report.json")
    on_record = [r for r in gpu_records.load_records(args.records) if r["hardware"] == hardware]
    content = {name: gpu_records.content_hash(path) for name, path in notebooks.items()}
    latest = resume(previous, on_record, hardware, passes, content)
    started, budget_s = time.strftime("%Y-%m-%d %H:%M"), 60 * args.budget_min
    plans = {p: plan(list(notebooks), latest[p], hardware, p, args.rerun) for p in passes}
    print(f"gpu-check on {hardware}, {args.budget_min:g} min: "
          + "; then ".join(f"profile {p}, {len(plans[p][0])} notebook(s), {jobs[p]} at a time" for p in passes),
          flush=True)
    for p in passes:
        order, skipped = plans[p]
        for name in order:
            took = estimate_s(latest[p].get(name), hardware, p)
            print(f"  {p:4s} {name:38s} {'never timed here' if took is None else f'took {took:.0f} s here'}",
                  flush=True)
        for name in skipped:
            print(f"  {p:4s} {name:38s} passed here on {latest[p][name].get('date')}: skipped (--rerun runs it "
                  "again)", flush=True)

    def left_s() -> float:
        return budget_s - REPORT_S - (_now() - t0)

    label = f"Executed {started} on {hardware}, by make gpu-check"  # each executed notebook's
    ran: list[tuple[str, str]] = []
    left: dict[str, list[str]] = {p: [] for p in passes}
    model = "cnn" if args.cpu else "resnet18"
    # the latest ladder and matmul table stay in the report, labelled, until this hardware measures its own
    ladder = previous.get("ladder") or {"not_run": "the notebooks come first"}
    matmul, share = previous.get("matmul", []), previous.get("training_share", {})
    traces = previous.get("traces") if (previous.get("traces") or {}).get("hardware") == hardware else None
    if not (ladder.get("hardware") == hardware and ladder.get("profile") == main_profile and "rungs" in ladder):
        measured = [r for r in on_record if "rungs" in (r.get("ladder") or {})
                    and r["ladder"].get("profile", r["profile"]) == main_profile]
        if measured:  # this GPU model's ladder on record: not measured again unless asked
            ladder, matmul, share = measured[-1]["ladder"], measured[-1]["matmul"], measured[-1].get("training_share", {})

    def save() -> dict[str, Any]:
        """The report as it stands, written after every notebook: a run stopped from outside (a lease that
        ends, ^C) leaves what it finished for the next run to resume from."""
        seconds = _now() - t0
        runs = [*previous.get("runs", []), {"started": started, "hardware": hardware, "profile": ", ".join(passes),
                                            "seconds": round(seconds, 1), "ran": [f"{p} {n}" for p, n in ran],
                                            "left": [f"{p} {n}" for p in passes for n in left[p]]}]
        report = {"hardware": hardware, "started": started, "profile": ", ".join(passes),
                  "torch": machine["env"]["torch"], "environment": machine["env"],
                  "notebooks": [r for p in sorted(latest) for r in latest[p].values()],
                  "ladder_model": ladder.get("model", model), "ladder": ladder, "matmul": matmul,
                  "training_share": share, "traces": traces, "seconds": seconds, "runs": runs}
        (args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (args.out / "report.md").write_text(markdown(report))
        return report

    for profile in passes:
        stamp = {"hardware": hardware, "profile": profile, "date": started, "torch": machine["env"]["torch"]}

        # the main profile's executed copies in executed/ (what make site shows), the ci pass's beside them
        suffix = "" if profile == main_profile else f"-{profile}"
        (logs / suffix.lstrip("-")).mkdir(exist_ok=True)

        def start(name: str, profile: str = profile, stamp: dict[str, Any] = stamp, suffix: str = suffix) -> dict:
            limit = min(args.notebook_timeout, left_s())
            r = {**run_notebook(notebooks[name], profile, limit, limit, logs / suffix.lstrip("-"),
                                machine["gpu_uuids"] if jobs[profile] == 1 else (),
                                executed=args.out / f"executed{suffix}", label=f"{label}, profile {profile}"),
                 **stamp, "content": content[name]}
            if r["timed_out"] and limit < args.notebook_timeout:  # the budget stopped it, not its own limit
                r["stopped_by_budget"] = True
            return r

        def done(name: str, r: dict[str, Any], profile: str = profile) -> None:
            ran.append((profile, name))
            if r.get("stopped_by_budget"):
                left[profile].append(name)
            if not r.get("stopped_by_budget") or not ran_here(latest[profile].get(name), hardware, profile):
                latest[profile][name] = r  # a cut run replaces no result; where there is none, it says how long
            peak = "" if r["peak_gpu_mib"] is None else f", peak {r['peak_gpu_mib']:,} MiB on the GPU(s)"
            print(f"  {profile:4s} {name:38s} {result_words(r)}  {r['cells_passed']} cells, {r['seconds']:.0f} s{peak}",
                  flush=True)
            save()

        def skip(name: str, profile: str = profile) -> None:
            left[profile].append(name)
            took = estimate_s(latest[profile].get(name), hardware, profile)
            why = "never timed here" if took is None else f"took {took:.0f} s here"
            print(f"  {profile:4s} {name:38s} left for the next run: {left_s():.0f} s of the budget left, {why}",
                  flush=True)

        run_in_turn(plans[profile][0], jobs[profile], lambda n, p=profile: need_s(latest[p].get(n), hardware, p),
                    left_s, start, done, skip)
        for name in left[profile]:
            latest[profile].setdefault(name, {"notebook": name, "profile": profile, "passed": False, "not_run": True,
                                              "timed_out": False, "cells_passed": 0, "cells_failed": 0,
                                              "seconds": 0.0, "peak_gpu_mib": None})

    def ladder_here() -> bool:
        return ladder.get("hardware") == hardware and ladder.get("profile") == main_profile and "rungs" in ladder

    if not ladder_here() or args.rerun:
        need = 1.2 * float(ladder.get("seconds") or 0) if ladder.get("hardware") == hardware else 0.0
        need, why = need or LADDER_GUESS_S[device], None
        if not all(current_here(latest[main_profile].get(n), hardware, main_profile) for n in notebooks):
            why = f"the notebooks come first; a run after each has a {main_profile} result here measures it"
        elif left_s() < need:
            why = f"{left_s():.0f} s of the budget were left and it takes about {need:.0f} s; the next run measures it"
        else:
            print(f"  ladder ({model}) ...", flush=True)
            ladder_args = (["--batch-size", "32", "--steps", "3", "--untimed-steps", "1", "--workers", "1"]
                           if args.cpu else [])
            begin = _now()
            ladder = run_ladder(model, ladder_args, args.out, min(600, left_s()), main_profile)
            ladder.update(hardware=hardware, profile=main_profile, date=started, torch=machine["env"]["torch"],
                          seconds=round(_now() - begin, 1), model=model)
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
                                   min(300, left_s()), main_profile),
                      "hardware": hardware, "profile": main_profile, "date": started, "torch": machine["env"]["torch"]}
    print(f"\n{markdown(save())}\nwritten: {args.out / 'report.md'} and report.json", flush=True)
    if ran or "rungs" in ladder and ladder.get("date") == started or (traces or {}).get("date") == started:
        record = make_record(started, machine, ", ".join(passes), [latest[p][n] for p, n in ran], ladder, matmul,
                             share, argv, args.cpu, traces)
        path = args.out / gpu_records.record_name(started, hardware)
        path.write_text(json.dumps(record, indent=2, default=str) + "\n")
        print(f"this run's record: {path}; commit it: cp {path} {args.records}/ and "
              "python scripts/gpu_records.py --write (the README's and INSTRUCTORS.md's tables)", flush=True)
    todo = [f"{n} ({p})" for p in passes for n in notebooks if not current_here(latest[p].get(n), hardware, p)]
    todo += [] if ladder_here() else ["the ladder"]
    if todo:
        print(f"left for the next run: {', '.join(todo)}; `make gpu-check` again resumes there", flush=True)
    failed = [n for p in passes for n in notebooks if not latest[p][n]["passed"]] + (["the ladder"] if "error" in ladder
                                                                                     else [])
    return 0 if not todo and not failed else 1


if __name__ == "__main__":
    sys.exit(main())
