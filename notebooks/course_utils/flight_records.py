"""Reading torch.distributed's flight records: each rank's last collectives, as the rank wrote them (notebook 11).

A record is what ``torch._C._distributed_c10d._dump_fr_trace()`` (gloo) or ``_dump_nccl_trace()`` (NCCL) returns:
a pickled dict whose ``entries`` hold, per collective, its sequence number in its process group, its name, the
shapes it was given, and the Python lines that called it. NCCL's entries also say whether the collective started
and finished; gloo's mark one that failed as finished too, so the course reads only what was entered. NCCL's
watchdog writes one per rank on a timeout (``$TORCH_FR_DUMP_TEMP_FILE<rank>``, with ``TORCH_NCCL_DUMP_ON_TIMEOUT=1``);
``scripts/faulty_ddp.py`` writes the same for gloo.
"""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Any

TORCH_FILES = re.compile(r"[/\\](torch|site-packages)[/\\]")


def read_flight_records(folder: str | Path, group: str = "0") -> dict[int, list[dict[str, Any]]]:
    """Each rank's collectives in process group ``group`` (the default group is "0"), oldest first:
    ``seq`` (the group's count of collectives, the same number on every rank for the same call), ``op``,
    ``shapes`` and ``where`` (the first line outside torch that called it). Files are named
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
            "where": f"{Path(caller['filename']).name}:{caller['line']}" if caller else "?"}


def records_table(records: dict[int, list[dict[str, Any]]], last: int = 3) -> str:
    """Each rank's last ``last`` collectives, one line a rank: what a person reads first."""
    lines = [f"{'rank':>4s}  {'entries':>7s}  last collectives (#seq op shapes where)"]
    for rank, entries in records.items():
        shown = ", ".join(f"#{e['seq']} {e['op']} {e['shapes']} {e['where']}" for e in entries[-last:])
        lines.append(f"{rank:4d}  {len(entries):7d}  {shown or '(none recorded)'}")
    return "\n".join(lines)
