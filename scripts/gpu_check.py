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
from gpu_plan import (current_here, estimate_s, need_s, pick_notebooks, plan, ran_here, resume,  # noqa: E402
                      run_in_turn)
from gpu_report import load_report, make_record, markdown, result_words  # noqa: E402
from gpu_runs import (flops_per_image, measure_matmul, read_machine, run_ladder, run_notebook, run_transformer,  # noqa: E402
                      run_traces, training_share)

REPORT_S = 30  # kept back at the end of the budget for the report
LADDER_GUESS_S = {"cuda": 360, "cpu": 120}  # the ladder's time before it has been measured on this hardware
TRACES_S = 90  # the per-rank traces: a short training run and its reading
TRANSFORMER_S = 120  # train_lm.py's tokens/s and MFU: one process, then FSDP2 over the GPUs
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


class Check:
    """One run: its plan, the notebooks of each pass, the ladder and the traces as the budget allows, and the
    report, written after every notebook (a run stopped from outside leaves what it finished for the next)."""

    def __init__(self, args: argparse.Namespace, argv: list[str] | None, machine: dict[str, Any],
                 notebooks: dict[str, Path], t0: float) -> None:
        self.args, self.argv, self.machine, self.notebooks, self.t0 = args, argv, machine, notebooks, t0
        self.passes = [args.profile] if args.profile else (["ci"] if args.cpu else ["ci", "full"])
        self.main_profile = self.passes[-1]  # the ladder's and the traces'
        self.jobs = {"ci": max(1, args.jobs or (1 if args.cpu else min(3, (os.cpu_count() or 1) // 5))), "full": 1}
        self.hardware, self.device = machine["hardware"], machine["device"]
        args.out.mkdir(parents=True, exist_ok=True)
        self.logs = args.out / "logs"
        self.logs.mkdir(exist_ok=True)
        self.previous = load_report(args.out / "report.json")
        self.on_record = [r for r in gpu_records.load_records(args.records) if r["hardware"] == self.hardware]
        self.content = {name: gpu_records.content_hash(path) for name, path in notebooks.items()}
        self.latest = resume(self.previous, self.on_record, self.hardware, self.passes, self.content)
        self.started, self.budget_s = time.strftime("%Y-%m-%d %H:%M"), 60 * args.budget_min
        self.plans = {p: plan(list(notebooks), self.latest[p], self.hardware, p, args.rerun) for p in self.passes}
        self.label = f"Executed {self.started} on {self.hardware}, by make gpu-check"  # each executed notebook's
        self.ran: list[tuple[str, str]] = []
        self.left: dict[str, list[str]] = {p: [] for p in self.passes}
        self.model = "cnn" if args.cpu else "resnet18"
        # the latest ladder and matmul table stay in the report, labelled, until this hardware measures its own
        self.ladder = self.previous.get("ladder") or {"not_run": "the notebooks come first"}
        self.matmul, self.share = self.previous.get("matmul", []), self.previous.get("training_share", {})
        traces = self.previous.get("traces")
        self.traces = traces if (traces or {}).get("hardware") == self.hardware else None
        transformer = self.previous.get("transformer")
        self.transformer = transformer if (transformer or {}).get("hardware") == self.hardware else None
        if not self.ladder_here():
            measured = [r for r in self.on_record if "rungs" in (r.get("ladder") or {})
                        and r["ladder"].get("profile", r["profile"]) == self.main_profile]
            if measured:  # this GPU model's ladder on record: not measured again unless asked
                last = measured[-1]
                self.ladder, self.matmul, self.share = last["ladder"], last["matmul"], last.get("training_share", {})

    def left_s(self) -> float:
        return self.budget_s - REPORT_S - (_now() - self.t0)

    def ladder_here(self) -> bool:
        return (self.ladder.get("hardware") == self.hardware and self.ladder.get("profile") == self.main_profile
                and "rungs" in self.ladder)

    def say(self, profile: str, name: str, what: str) -> None:
        print(f"  {profile:4s} {name:38s} {what}", flush=True)

    def print_plan(self) -> None:
        print(f"gpu-check on {self.hardware}, {self.args.budget_min:g} min: "
              + "; then ".join(f"profile {p}, {len(self.plans[p][0])} notebook(s), {self.jobs[p]} at a time"
                               for p in self.passes), flush=True)
        for p in self.passes:
            order, skipped = self.plans[p]
            for name in order:
                took = estimate_s(self.latest[p].get(name), self.hardware, p)
                self.say(p, name, "never timed here" if took is None else f"took {took:.0f} s here")
            for name in skipped:
                self.say(p, name, f"passed here on {self.latest[p][name].get('date')}: skipped (--rerun runs it again)")

    def save(self) -> dict[str, Any]:
        seconds, passes = _now() - self.t0, ", ".join(self.passes)
        runs = [*self.previous.get("runs", []),
                {"started": self.started, "hardware": self.hardware, "profile": passes, "seconds": round(seconds, 1),
                 "ran": [f"{p} {n}" for p, n in self.ran],
                 "left": [f"{p} {n}" for p in self.passes for n in self.left[p]]}]
        report = {"hardware": self.hardware, "started": self.started, "profile": passes,
                  "torch": self.machine["env"]["torch"], "environment": self.machine["env"],
                  "notebooks": [r for p in sorted(self.latest) for r in self.latest[p].values()],
                  "ladder_model": self.ladder.get("model", self.model), "ladder": self.ladder, "matmul": self.matmul,
                  "training_share": self.share, "traces": self.traces, "transformer": self.transformer,
                  "seconds": seconds, "runs": runs}
        (self.args.out / "report.json").write_text(json.dumps(report, indent=2, default=str))
        (self.args.out / "report.md").write_text(markdown(report))
        return report

    def run_pass(self, profile: str) -> None:
        """Every notebook of ``profile``'s plan that fits the budget, ``jobs[profile]`` at a time."""
        stamp = {"hardware": self.hardware, "profile": profile, "date": self.started,
                 "torch": self.machine["env"]["torch"]}
        # the main profile's executed copies in executed/ (what make site shows), the ci pass's beside them
        suffix = "" if profile == self.main_profile else f"-{profile}"
        logs = self.logs / suffix.lstrip("-")
        logs.mkdir(exist_ok=True)
        latest, args = self.latest[profile], self.args

        def start(name: str) -> dict[str, Any]:
            limit = min(args.notebook_timeout, self.left_s())
            took = estimate_s(latest.get(name), self.hardware, profile)
            self.say(profile, name, "starting" + ("" if took is None else f" (took {took:.0f} s here last time)")
                     + f", at most {limit:.0f} s")
            r = {**run_notebook(self.notebooks[name], profile, limit, limit, logs,
                                self.machine["gpu_uuids"] if self.jobs[profile] == 1 else (),
                                executed=args.out / f"executed{suffix}", label=f"{self.label}, profile {profile}"),
                 **stamp, "content": self.content[name]}
            if r["timed_out"] and limit < args.notebook_timeout:  # the budget stopped it, not its own limit
                r["stopped_by_budget"] = True
            return r

        def done(name: str, r: dict[str, Any]) -> None:
            self.ran.append((profile, name))
            if r.get("stopped_by_budget"):
                self.left[profile].append(name)
            if not r.get("stopped_by_budget") or not ran_here(latest.get(name), self.hardware, profile):
                latest[name] = r  # a cut run replaces no result; where there is none, it says how long
            peak = "" if r["peak_gpu_mib"] is None else f", peak {r['peak_gpu_mib']:,} MiB on the GPU(s)"
            self.say(profile, name, f"{result_words(r)}  {r['cells_passed']} cells, {r['seconds']:.0f} s{peak}")
            self.save()

        def skip(name: str) -> None:
            self.left[profile].append(name)
            took = estimate_s(latest.get(name), self.hardware, profile)
            why = "never timed here" if took is None else f"took {took:.0f} s here"
            self.say(profile, name, f"left for the next run: {self.left_s():.0f} s of the budget left, {why}")

        run_in_turn(self.plans[profile][0], self.jobs[profile], lambda n: need_s(latest.get(n), self.hardware, profile),
                    self.left_s, start, done, skip)
        for name in self.left[profile]:
            latest.setdefault(name, {"notebook": name, "profile": profile, "passed": False, "not_run": True,
                                     "timed_out": False, "cells_passed": 0, "cells_failed": 0, "seconds": 0.0,
                                     "peak_gpu_mib": None})

    def measure_ladder(self) -> None:
        """The ladder and the matmul rates, once every notebook has a main-profile result here."""
        if self.ladder_here() and not self.args.rerun:
            return
        ladder, model, main = self.ladder, self.model, self.main_profile
        need = 1.2 * float(ladder.get("seconds") or 0) if ladder.get("hardware") == self.hardware else 0.0
        need, why = need or LADDER_GUESS_S[self.device], None
        if not all(current_here(self.latest[main].get(n), self.hardware, main) for n in self.notebooks):
            why = f"the notebooks come first; a run after each has a {main} result here measures it"
        elif self.left_s() < need:
            why = (f"{self.left_s():.0f} s of the budget were left and it takes about {need:.0f} s; the next run "
                   "measures it")
        else:
            print(f"  ladder ({model}) ...", flush=True)
            ladder_args = (["--batch-size", "32", "--steps", "3", "--untimed-steps", "1", "--workers", "1"]
                           if self.args.cpu else [])
            begin = _now()
            self.ladder = run_ladder(model, ladder_args, self.args.out, min(600, self.left_s()), main)
            self.ladder.update(hardware=self.hardware, profile=main, date=self.started,
                               torch=self.machine["env"]["torch"], seconds=round(_now() - begin, 1), model=model)
            self.matmul = measure_matmul(self.device, self.args.cpu)
            self.share = (training_share(self.ladder, self.matmul, flops_per_image(model))
                          if "error" not in self.ladder else {})
        if why:
            print(f"  ladder ({model}) not measured on this hardware: {why}", flush=True)
            if "rungs" not in self.ladder:
                self.ladder = {"not_run": why}

    def record_traces(self) -> None:
        """Notebook 03's per-rank traces, after the notebooks and the ladder, as the budget allows."""
        traced = self.traces is not None and "error" not in self.traces
        if not self.ladder_here() or (traced and not self.args.rerun):
            return
        if self.left_s() < TRACES_S:
            print(f"  per-rank traces not recorded: {self.left_s():.0f} s of the budget left; the next run records "
                  "them", flush=True)
            return
        print("  per-rank traces (train.py --trace-dir, read by course_utils.traces and HTA) ...", flush=True)
        self.traces = {**run_traces(self.args.out, len(self.machine["env"].get("gpus") or []), self.args.cpu,
                                    min(300, self.left_s()), self.main_profile),
                       "hardware": self.hardware, "profile": self.main_profile, "date": self.started,
                       "torch": self.machine["env"]["torch"]}

    def measure_transformer(self) -> None:
        """scripts/train_lm.py's tokens/s and MFU, after the notebooks, the ladder and the traces, as the budget
        allows (once per hardware unless --rerun)."""
        done = self.transformer is not None and all("error" not in r for r in self.transformer["layouts"].values())
        if not self.ladder_here() or (done and not self.args.rerun):
            return
        if self.left_s() < TRANSFORMER_S:
            print(f"  the transformer's tokens/s not measured: {self.left_s():.0f} s of the budget left; the next run "
                  "measures it", flush=True)
            return
        print("  the transformer's tokens/s and MFU (scripts/train_lm.py) ...", flush=True)
        self.transformer = {**run_transformer(self.args.out, len(self.machine["env"].get("gpus") or []), self.args.cpu,
                                              min(300, self.left_s()), self.main_profile),
                            "hardware": self.hardware, "profile": self.main_profile, "date": self.started,
                            "torch": self.machine["env"]["torch"]}
        self.save()

    def finish(self) -> int:
        """The report, this run's record, what is left; 0 when nothing is left and nothing failed."""
        print(f"\n{markdown(self.save())}\nwritten: {self.args.out / 'report.md'} and report.json", flush=True)
        ladder, passes = self.ladder, self.passes
        if self.ran or "rungs" in ladder and ladder.get("date") == self.started \
                or (self.traces or {}).get("date") == self.started \
                or (self.transformer or {}).get("date") == self.started:
            record = make_record(self.started, self.machine, ", ".join(passes),
                                 [self.latest[p][n] for p, n in self.ran], ladder, self.matmul, self.share,
                                 self.argv, self.args.cpu, self.traces, self.transformer)
            path = self.args.out / gpu_records.record_name(self.started, self.hardware)
            path.write_text(json.dumps(record, indent=2, default=str) + "\n")
            print(f"this run's record: {path}; commit it: cp {path} {self.args.records}/ and "
                  "python scripts/gpu_records.py --write (CONTRIBUTING.md's and INSTRUCTORS.md's tables)", flush=True)
        todo = [f"{n} ({p})" for p in passes for n in self.notebooks
                if not current_here(self.latest[p].get(n), self.hardware, p)]
        todo += [] if self.ladder_here() else ["the ladder"]
        if todo:
            print(f"left for the next run: {', '.join(todo)}; `make gpu-check` again resumes there", flush=True)
        failed = [n for p in passes for n in self.notebooks if not self.latest[p][n]["passed"]]
        failed += ["the ladder"] if "error" in ladder else []
        return 0 if not todo and not failed else 1


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = _now()
    lacking = what_is_lacking()
    if lacking:
        print(lacking, file=sys.stderr)
        return 2
    notebooks = {path.name: path for path in pick_notebooks(NOTEBOOKS, args.notebooks)}
    machine = read_machine(args.cpu)
    if isinstance(machine, str):
        print(machine, file=sys.stderr)
        return 2
    check = Check(args, argv, machine, notebooks, t0)
    check.print_plan()
    for profile in check.passes:
        check.run_pass(profile)
    check.measure_ladder()
    check.record_traces()
    check.measure_transformer()
    return check.finish()


if __name__ == "__main__":
    sys.exit(main())
