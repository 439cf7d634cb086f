"""Notebook 11: the rank that is behind, from the ranks' flight records."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .core import ExerciseNotDone, WrongAnswer, passed

Records = dict[int, list[dict[str, Any]]]


def _entry(seq: int, op: str, state: str) -> dict[str, Any]:
    return {"seq": seq, "op": op, "shapes": [[2372]], "where": "train.py:94", "state": state}


def made_records(world: int, last: int, behind: int, behind_last: int, keep: int | None = None,
                 ops: tuple[tuple[int, str], ...] = (), queued: int = 0, behind_queued: int = 0) -> Records:
    """Flight records of ``world`` ranks: every rank completed collectives 1..``last`` - 1 and waits in ``last``
    (started), except rank ``behind``, whose last was ``behind_last`` (completed); ``keep``: each rank's recorder
    holds only its last ``keep`` entries (a buffer that wrapped round); ``ops``: the operation of a sequence
    number, else all_reduce; ``queued``: collectives the waiting ranks' CPUs issued after the one they wait in
    (NCCL's are asynchronous: a CPU runs ahead of its GPU), recorded as scheduled; ``behind_queued``: the same
    on rank ``behind``, whose GPU is stuck in a kernel of its own while its CPU issued the next collectives."""
    ops = dict(ops)
    records = {}
    for rank in range(world):
        if rank == behind:
            entries = [_entry(s, ops.get(s, "all_reduce"), "completed" if s <= behind_last else "scheduled")
                       for s in range(1, behind_last + behind_queued + 1)]
        else:
            entries = [_entry(s, ops.get(s, "all_reduce"),
                              "completed" if s < last else "started" if s == last else "scheduled")
                       for s in range(1, last + queued + 1)]
        records[rank] = entries[-keep:] if keep else entries
    return records


# (what the case stands for, made_records' arguments) -> the answer: (rank, seq, op)
BEHIND_CASES = [
    ("4 ranks, rank 2 stuck in its data loading", dict(world=4, last=5, behind=2, behind_last=4), (2, 5, "all_reduce")),
    ("8 ranks, each recorder kept its last 4 entries", dict(world=8, last=10, behind=6, behind_last=9, keep=4),
     (6, 10, "all_reduce")),
    ("rank 0 writing a checkpoint while the others wait in a barrier",
     dict(world=4, last=4, behind=0, behind_last=3, ops=((4, "barrier"),)), (0, 4, "barrier")),
    ("an all_gather after all_reduces, 3 ranks", dict(world=3, last=6, behind=1, behind_last=5, ops=((6, "all_gather"),)),
     (1, 6, "all_gather")),
    ("NCCL, 4 ranks: the waiting ranks' CPUs queued 3 more collectives (a broadcast first) behind the one they wait in",
     dict(world=4, last=7, behind=3, behind_last=6, queued=3, ops=((8, "broadcast"),)), (3, 7, "all_reduce")),
    ("rank 1 stuck before its first collective", dict(world=2, last=1, behind=1, behind_last=0), (1, 1, "all_reduce")),
    ("NCCL, 4 ranks: rank 2's GPU stuck in a kernel of its own, while its CPU issued the next 3 collectives as the "
     "others' did", dict(world=4, last=7, behind=2, behind_last=6, queued=2, behind_queued=3), (2, 7, "all_reduce")),
]


def check_behind(behind: Callable[[Records], tuple[int, int, str]], run_records: Records, stuck_rank: int) -> None:
    """``behind(records)`` -> (the rank that is behind, the sequence number of the collective it never entered,
    that collective's operation): on this run's records, where ``stuck_rank`` is the rank the run held back
    (``faulty_ddp.py --stuck-rank``), then on records of runs not made here."""
    missed = max(e["seq"] for e in run_records[stuck_rank]) + 1  # the next call: the others entered it
    op = next(e["op"] for rank, entries in run_records.items() if rank != stuck_rank for e in entries
              if e["seq"] == missed)
    cases = [("this run", run_records, (stuck_rank, missed, op))]
    cases += [(name, made_records(**shape), want) for name, shape, want in BEHIND_CASES]
    for name, records, want in cases:
        try:
            got = behind(records)
        except ExerciseNotDone:
            raise
        except Exception as exc:  # records unlike this run's: say which, not a traceback into the checker
            raise WrongAnswer(f"{name}: your function raised {type(exc).__name__}: {exc}") from exc
        try:
            rank, seq, op = got
        except (TypeError, ValueError):
            raise WrongAnswer(f"{name}: return (rank, seq, op), not {got!r}") from None
        if int(rank) != want[0]:
            reached = max((e["seq"] for e in records.get(int(rank), [])), default=None)
            raise WrongAnswer(f"{name}: rank {rank}'s recorder reaches collective #{reached}; another rank is "
                              "further behind (where the entries say started or completed, they tell what a GPU "
                              "ran, not only what its CPU issued)")
        if int(seq) != want[1]:
            raise WrongAnswer(f"{name}: rank {rank} is the one, but #{seq} is not the collective it never entered "
                              f"(look at the last sequence number its recorder holds)")
        if op != want[2]:
            raise WrongAnswer(f"{name}: collective #{seq} is right, but the others entered it as '{want[2]}', not "
                              f"'{op}' (the rank that is behind has no entry for it)")
    passed("the rank whose collectives stop earliest (NCCL's: the last its GPU started, not the last its CPU "
           "issued), and the next sequence number, which the others entered and wait in; its operation is in their "
           "records")
