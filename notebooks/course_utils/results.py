"""The ``RESULT {json}`` line: how a script hands its numbers to a notebook, a test or a job log.

A script prints exactly one such line, from rank 0, as its last word
(:func:`emit_result`); whoever ran it reads it back from the output (:func:`parse_result`)
or from a Slurm job's log (:func:`results_in_log`).
"""

from __future__ import annotations

import json
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
