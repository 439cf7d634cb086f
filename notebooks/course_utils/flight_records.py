"""Reading torch.distributed's flight records: each rank's last collectives, as the rank wrote them (notebook 11).

A record is what ``torch._C._distributed_c10d._dump_fr_trace()`` (gloo) or ``_dump_nccl_trace()`` (NCCL) returns:
a pickled dict whose ``entries`` hold, per collective, its sequence number in its process group, its name, the
shapes it was given, and the Python lines that called it. NCCL's entries also say whether the collective started
and finished; gloo's mark one that failed as finished too, so the course reads only what was entered. NCCL's
watchdog writes one per rank on a timeout (``$TORCH_FR_DUMP_TEMP_FILE<rank>``, with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``);
``scripts/faulty_ddp.py`` writes the same for gloo.

While a job runs, torch's debug server (``torch.distributed.debug.start_debug_server``, served by rank 0) shows
every rank's Python stacks and flight record over HTTP; :func:`read_debug_server` reads a page of it as text.
"""

from __future__ import annotations

import html
import pickle
import re
import textwrap
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from .waiting import wait_until

TORCH_FILES = re.compile(r"[/\\](torch|site-packages)[/\\]")


def read_flight_records(folder: str | Path, group: str = "0") -> dict[int, list[dict[str, Any]]]:
    """Each rank's collectives in process group ``group`` (the default group is "0"), oldest first:
    ``seq`` (the group's count of collectives, the same number on every rank for the same call), ``op``,
    ``shapes``, ``where`` (the first line outside torch that called it) and ``state`` (gloo's recorder
    marks every call scheduled; NCCL's also started and completed, as the GPU runs it). Files are named
    ``<prefix><rank>``; a folder without any is an error that says what to set."""
    files = sorted(p for p in Path(folder).glob("*") if re.search(r"\d+$", p.name))
    if not files:
        raise FileNotFoundError(f"no flight records in {folder}: the ranks write them on a failure (NCCL: "
                                f"TORCH_FR_DUMP_TEMP_FILE=<folder>/rank_ and TORCH_FR_BUFFER_SIZE above 0)")
    records = {}
    for path in files:
        rank = int(re.search(r"(\d+)$", path.name).group(1))
        raw = pickle.loads(path.read_bytes())
        records[rank] = [_entry(e) for e in raw.get("entries", []) if str(e["process_group"][0]) == group]
    return dict(sorted(records.items()))


def _entry(e: dict[str, Any]) -> dict[str, Any]:
    caller = next((f for f in e.get("frames", []) if not TORCH_FILES.search(f["filename"])), None)
    return {"seq": e["collective_seq_id"], "op": e["profiling_name"].split(":")[-1],
            "shapes": [list(s) for s in e["input_sizes"]],
            "where": f"{Path(caller['filename']).name}:{caller['line']}" if caller else "?",
            "state": e.get("state", "?")}


def records_table(records: dict[int, list[dict[str, Any]]], last: int = 3) -> str:
    """Each rank's last ``last`` collectives, one line a rank: what a person reads first."""
    lines = [f"{'rank':>4s}  {'entries':>7s}  last collectives (#seq op shapes where)"]
    for rank, entries in records.items():
        shown = ", ".join(f"#{e['seq']} {e['op']} {e['shapes']} {e['where']}" for e in entries[-last:])
        lines.append(f"{rank:4d}  {len(entries):7d}  {shown or '(none recorded)'}")
    return "\n".join(lines)


def read_debug_server(port: int, page: str = "stacks", host: str = "127.0.0.1", wait_s: float = 60) -> dict[int, str]:
    """Each rank's part of a page of torch's debug server, as text: ``stacks`` (every thread's Python stack, as
    ``faulthandler`` prints it) or ``fr_trace_json`` (the flight record). Waits up to ``wait_s`` for the server."""
    def fetch() -> str | None:
        try:
            with urllib.request.urlopen(f"http://{host}:{port}/{page}", timeout=30) as response:
                return response.read().decode(errors="replace")
        except (urllib.error.URLError, ConnectionError):
            return None  # not serving yet

    body = wait_until(fetch, wait_s, f"nothing answered on {host}:{port} within {wait_s:.0f} s: did rank 0 call "
                                     "torch.distributed.debug.start_debug_server(port=...)?", interval_s=0.5)
    # the page's tags out, not a frame's name in angle brackets (faulthandler's <module>, <lambda>, ...)
    tags = r"</?(?!(?:module|lambda|listcomp|dictcomp|setcomp|genexpr)>)[a-zA-Z][^>]*>"
    text = html.unescape(re.sub(tags, "", body.split("</nav>", 1)[-1]))
    parts = re.split(r"^\s*Rank (\d+): \S+\s*$", text, flags=re.M)  # each rank's part starts with its address
    return {int(rank): re.sub(r"\n\s*\n", "\n", textwrap.dedent(part)).strip()
            for rank, part in zip(parts[1::2], parts[2::2])}


def py_spy_dump(pid: int | None) -> str:
    """``py-spy dump --pid PID``: the Python line each thread of a live process is on, read from its memory
    (the command printed as you would type it; the output without the colours a notebook's kernel asks for)."""
    import sys

    from .launch import run_command

    if pid is None:
        return "(no such process: it ended before the dump)"
    beside = Path(sys.executable).with_name("py-spy")  # installed with the course, beside its Python
    run = run_command([beside if beside.exists() else "py-spy", "dump", "--pid", pid], timeout_s=30, check=False,
                      echo=False)
    return re.sub(r"\x1b\[[0-9;]*m", "", run.output)


# TORCH_DISTRIBUTED_DEBUG=DETAIL's error names each rank's call as a fingerprint
_FINGERPRINT = re.compile(r"Rank (\d+) is running collective: CollectiveFingerPrint\(SequenceNumber=(\d+), "
                          r"OpType=(\w+), TensorShape=\[([^\]]*)\]")


def detail_mismatch(lines: list[str]) -> tuple[str, dict[int, tuple[int, str, list[int]]]]:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL's report, in a run's output, of ranks calling different collectives (from its
    first words, the log's prefix left out), and what it names for each rank: (sequence number, operation,
    shape). ('', {}) without one."""
    reports = [line for line in lines if "Detected mismatch" in line]  # each rank's, some cut short by its script
    named = {int(rank): (int(seq), op, [int(x) for x in shape.split(",") if x.strip()])
             for line in reports for rank, seq, op, shape in _FINGERPRINT.findall(line)}
    line = max(reports, key=len, default="")  # faulty_ddp.py prints the error's first line, then the record's path
    return line[line.find("Detected mismatch"):].split("; flight record written")[0] if line else "", named


def frames_only(stack: str) -> str:
    """A py-spy dump or a debug server's stack without its headers (the process's command line, Python's path, the
    server's own thread, which has no frames): each thread and its frames, innermost first, with paths from the
    repository's root."""
    from .show import relative

    lines = [line for line in stack.splitlines()
             if line.strip() and not line.startswith(("Process ", "Python v", "Current thread"))]
    return relative("\n".join(lines))
