"""The course's GPU runs, one JSON record a run in records/gpu/, committed: what `make gpu-check` resumes from
and what the README's and INSTRUCTORS.md's GPU tables are generated from. The standard library only (gpu_check.py
reads these before it knows what the machine lacks).

A notebook's result counts for the notebook's current content only: ``content`` is a hash of its code cells
(markdown edits keep a result; a changed line of code asks for a new run)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
RECORDS = REPO_ROOT / "records" / "gpu"


def content_hash(notebook: Path) -> str:
    """12 hex digits of the SHA-256 of a notebook's code cells, in order (outputs and markdown ignored)."""
    cells = json.loads(Path(notebook).read_text())["cells"]
    code = "\n\x00\n".join("".join(c["source"]) if isinstance(c["source"], list) else c["source"]
                           for c in cells if c["cell_type"] == "code")
    return hashlib.sha256(code.encode()).hexdigest()[:12]


def load_records(folder: Path = RECORDS) -> list[dict[str, Any]]:
    """Every record, oldest first (by date, then file name)."""
    records = []
    for path in sorted(Path(folder).glob("*.json")):
        record = json.loads(path.read_text())
        record["file"] = path.name
        records.append(record)
    return sorted(records, key=lambda r: (r["date"], r["file"]))
