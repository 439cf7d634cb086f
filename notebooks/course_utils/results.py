"""The ``RESULT {json}`` line: how a script hands its numbers to a notebook, a test or a job log; and the lines the
take-home scripts print for a person, read back.

A script prints exactly one such line, from rank 0, as its last word
(:func:`emit_result`); whoever ran it reads it back from the output (:func:`parse_result`)
or from a Slurm job's log (:func:`results_in_log`).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

PREFIX = "RESULT "


def emit_result(result: dict[str, Any]) -> None:
    """Print ``result`` as the RESULT line, on rank 0 only."""
    from .process_group import print0  # late: reading results needs no torch.distributed

    print0(PREFIX + json.dumps(result))


def results_in(output: str) -> list[dict[str, Any]]:
    """Every RESULT line in ``output``, in order (a job array task may run several trials)."""
    return [json.loads(line[len(PREFIX):]) for line in output.splitlines() if line.startswith(PREFIX)]


def parse_result(output: str) -> dict[str, Any]:
    """The last RESULT line of a run's output."""
    results = results_in(output)
    if not results:
        raise ValueError("the run printed no RESULT line; see its output above")
    return results[-1]


def results_in_log(path: str | Path) -> list[dict[str, Any]]:
    """The RESULT lines of a job's log file."""
    return results_in(Path(path).read_text())


# The take-home scripts (scripts/plain_*.py) print for a person, not a RESULT line: read back here, in one place.
_PLAIN_EPOCH = re.compile(r"^epoch (\d+): loss ([0-9.]+) \((\d+) steps of", re.M)
_PLAIN_SHARES = re.compile(r"^done: .*parameters held per rank: \[([0-9, ]+)\] of (\d+)$", re.M)
_PLAIN_DONE = re.compile(r"^done: (\d+) ranks, (\d+) per node; weights identical on every rank: (True|False)$", re.M)


def plain_epochs(output: str) -> list[float]:
    """The loss of each epoch a plain script printed, in order."""
    return [float(loss) for _, loss, _ in _PLAIN_EPOCH.findall(output)]


def plain_steps(output: str) -> list[int]:
    """The optimiser steps of each epoch a plain script printed (this start's, for a resumed epoch)."""
    return [int(steps) for _, _, steps in _PLAIN_EPOCH.findall(output)]


def plain_summary(output: str) -> dict[str, Any]:
    """plain_ddp.py's or plain_resumable.py's last line: world size, ranks per node, whether the weights agreed."""
    found = _PLAIN_DONE.findall(output)
    if not found:
        raise ValueError("the run printed no 'done: ...' line; see its output above")
    world, per_node, identical = found[-1]
    return {"world_size": int(world), "per_node": int(per_node), "identical": identical == "True"}


def plain_shares(output: str) -> tuple[list[int], int]:
    """plain_fsdp.py's last line: the parameters each rank held, and the model's."""
    found = _PLAIN_SHARES.findall(output)
    if not found:
        raise ValueError("the run printed no 'done: ... parameters held per rank' line; see its output above")
    shares, total = found[-1]
    return [int(n) for n in shares.split(",")], int(total)
