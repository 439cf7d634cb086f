"""Which notebooks a gpu-check run takes, in which order, and whether one still fits the budget.

A run resumes from what is on record for this hardware and profile: first what has no finished result here
(never run, or stopped by the budget), then what failed, then what passed on older code; what passed on the
current code is skipped. Within each, the notebooks never run on a GPU in full first (PRIORITY), then by number.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any

import gpu_records

# never run on a GPU in the full profile (01, 02, 04, 08, 11, 12), then 06 and 07 (stopped by leases' budgets)
PRIORITY = ("01", "02", "04", "08", "11", "12", "06", "07")
MIN_START_S = 120  # a notebook never timed on this hardware starts only with this much of the budget left


def pick_notebooks(folder: Path, wanted: Sequence[str] | None) -> list[Path]:
    found = sorted(folder.glob("[0-9][0-9]_*.ipynb"))
    if not wanted:
        return found
    chosen = [p for p in found if any(p.name.startswith(w) for w in wanted)]
    missing = [w for w in wanted if not any(p.name.startswith(w) for p in found)]
    if missing:
        raise SystemExit(f"error: no notebook starts with {', '.join(missing)} (there are: "
                         f"{', '.join(p.name[:2] for p in found)})")
    return chosen


def ran_here(r: Mapping[str, Any] | None, hardware: str, profile: str) -> bool:
    """Whether ``r`` is a finished result (not left or cut by a budget) from this hardware and profile."""
    return (r is not None and r.get("hardware") == hardware and r.get("profile") == profile
            and not r.get("not_run") and not r.get("stopped_by_budget"))


def current_here(r: Mapping[str, Any] | None, hardware: str, profile: str) -> bool:
    """A finished result here of the notebook's current code."""
    return ran_here(r, hardware, profile) and not r.get("older_code")


def tier(r: Mapping[str, Any] | None, hardware: str, profile: str) -> int:
    """0: no finished result here; 1: failed here; 2: passed here on older code; 3: passed here on this code."""
    if not ran_here(r, hardware, profile):
        return 0
    if not r["passed"]:
        return 1
    return 2 if r.get("older_code") else 3


def plan(names: Sequence[str], latest: Mapping[str, Mapping[str, Any]], hardware: str, profile: str,
         rerun: bool = False) -> tuple[list[str], list[str]]:
    """The order this run takes ``names`` in, and those it skips as passed here on their current code (none with
    ``rerun``, which runs them last)."""
    def key(name: str) -> tuple[int, int, str]:
        risk = PRIORITY.index(name[:2]) if name[:2] in PRIORITY else len(PRIORITY)
        return tier(latest.get(name), hardware, profile), risk, name

    order = sorted(names, key=key)
    skipped = [n for n in order if tier(latest.get(n), hardware, profile) == 3]
    return (order, []) if rerun else ([n for n in order if n not in skipped], skipped)


def estimate_s(r: Mapping[str, Any] | None, hardware: str, profile: str) -> float | None:
    """How long a notebook took on this hardware and profile (at least: a run cut by the budget counts too)."""
    if r and r.get("hardware") == hardware and r.get("profile") == profile and not r.get("not_run"):
        return float(r.get("seconds") or 0) or None
    return None


def need_s(r: Mapping[str, Any] | None, hardware: str, profile: str) -> float:
    """The budget a notebook needs left to start: its time here and a fifth, or MIN_START_S never timed here."""
    estimate = estimate_s(r, hardware, profile)
    return MIN_START_S if estimate is None else 1.2 * estimate


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
