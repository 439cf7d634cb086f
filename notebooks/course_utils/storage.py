"""The storage lesson: one large file versus many small files.

Parallel file systems (Lustre on FT3 and Frontera) stream big files fast but
pay a metadata round trip for every file created; home directories are often
NFS with small quotas. Writing the same bytes as one file and as thousands of
small ones, with and without ``fsync``, shows the difference on each folder.
Notebook 10 also flushes and drops the pages of its data sets here, and reads
what ``data/stage.sh`` printed when it copied one to a node (:func:`staged_copies`).
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

# Where code, environments and data belong on each cluster.
STORAGE_VARS = {
    "HOME": "home: small quota, backed up; code and dotfiles (both clusters)",
    "STORE": "FT3 permanent project storage: conda envs, data sets",
    "LUSTRE": "FT3 Lustre: large files, fast parallel I/O",
    "LUSTRE_SCRATCH": "FT3 Lustre scratch: job I/O, purged",
    "WORK": "Frontera $WORK: envs, code, data sets (not purged)",
    "SCRATCH": "Frontera $SCRATCH: job I/O, large and fast, purged (see TACC policy)",
    "TMPDIR": "node-local temporary folder: fastest for small files, gone after the job",
}


NODE_LOCAL = ("$TMPDIR",)
"""Folders on the node's own disk: the full small-file test runs there."""

SHARED_SMALL_FILES = 256
"""At most this many small files on a shared file system: thirty learners each creating
thousands of files at once is the metadata storm the centres' rules forbid."""


def small_file_cap(target: str) -> int | None:
    """How many small files the test may create in ``target`` (None: no cap, the node's own disk)."""
    return None if target in NODE_LOCAL else SHARED_SMALL_FILES


@dataclass
class WriteResult:
    target: str
    path: str
    pattern: str  # "1 x 64 MiB" or "4096 x 16 KiB"
    fsync: bool
    seconds: float
    mib_per_s: float
    files_per_s: float
    op: str = "write"  # or "read": opening and reading the files back, as a data epoch does


def storage_targets(include_cwd: bool = True) -> dict[str, Path]:
    """Folders to measure: every storage variable that is set and exists, plus
    the working directory (the only one on a laptop or CI)."""
    targets: dict[str, Path] = {}
    for var in STORAGE_VARS:
        value = os.environ.get(var)
        if value and Path(value).is_dir() and os.access(value, os.W_OK):
            targets[f"${var}"] = Path(value)
    if include_cwd:
        targets["cwd"] = Path.cwd()
    return targets


def _write_files(folder: Path, n_files: int, file_bytes: int, fsync: bool) -> float:
    block = os.urandom(min(file_bytes, 1 << 20))
    start = time.perf_counter()
    for i in range(n_files):
        with open(folder / f"f{i:06d}.bin", "wb") as fh:
            left = file_bytes
            while left > 0:
                chunk = block[: min(left, len(block))]
                fh.write(chunk)
                left -= len(chunk)
            if fsync:
                fh.flush()
                os.fsync(fh.fileno())
    return time.perf_counter() - start


def sync_files(paths: Iterable[Path]) -> None:
    """Flush each file to the storage (``fsync``), as a data set copied there would be: dropping the cached
    pages of a file (:func:`drop_cached_pages`) only works for pages already written."""
    for path in paths:
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())


def drop_cached_pages(paths: Iterable[Path]) -> None:
    """Ask the kernel to forget the cached pages of ``paths`` (clean pages: they were fsync'd), so the
    next read comes from the storage. To do so it opens every file, so a timed read right after finds each
    file's metadata (its directory entry and inode) in this node's caches: this flatters many small files,
    whose cost on a parallel file system is a metadata request per open."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# What data/stage.sh prints for each node: the copy it made and how long it took, or that the copy was there
_STAGED = re.compile(r"staged (?P<name>\S+) on (?P<node>[^:\s]+): (?:(?P<mib>\d+) MiB, \s*(?P<files>\d+) files, "
                     r"from (?P<source>.+) to (?P<target>.+) in (?P<ms>\d+) ms|already there \((?P<there>.+)\))")


def staged_copies(log: str) -> list[dict]:
    """The lines ``data/stage.sh`` printed in ``log``, one per node (and per call), parsed: ``name``,
    ``node``, ``ms`` (the copy's milliseconds; None where the node found the copy already there, made by
    an earlier call or by another task on the same path) and ``target`` (where the copy is). Two tasks that
    copy to the same path at once both print a time; the second's rename fails and its copy is deleted."""
    found = []
    for line in log.splitlines():
        if not line.startswith("staged "):
            continue
        match = _STAGED.fullmatch(line.strip())
        if match is None:
            raise ValueError(f"a line of data/stage.sh that this parser does not know: {line!r}. If stage.sh's "
                             "messages changed, change course_utils.storage.staged_copies with them")
        copied = match["ms"] is not None
        # a copy's line names the folder it copied into; the copy is that folder's <name>
        found.append({"name": match["name"], "node": match["node"], "ms": int(match["ms"]) if copied else None,
                      "target": f"{match['target']}/{match['name']}" if copied else match["there"]})
    return found


def _read_files(folder: Path, n_files: int) -> float:
    """Open and read every file, as a data epoch does. Their pages are first dropped from
    this node's cache (``POSIX_FADV_DONTNEED``; they were fsync'd, so they are clean), so the
    bytes come from the storage; the metadata caches stay warm, which flatters small files."""
    names = [folder / f"f{i:06d}.bin" for i in range(n_files)]
    drop_cached_pages(names)
    start = time.perf_counter()
    for name in names:
        with open(name, "rb", buffering=0) as fh:
            while fh.read(1 << 20):
                pass
    return time.perf_counter() - start


def measure_writes(
    name: str,
    folder: str | Path,
    total_mib: int = 64,
    small_kib: int = 16,
    fsync_options: tuple[bool, ...] = (False, True),
    max_small_files: int | None = None,
    read_back: bool = False,
) -> list[WriteResult]:
    """Write ``total_mib`` as one file and as ``total_mib*1024/small_kib`` files (at most
    ``max_small_files`` of them: see :func:`small_file_cap`).

    Everything is written to a temporary sub-folder that is removed afterwards. With
    ``read_back``, the fsync'd files are also read back (``op="read"`` rows).
    Without ``fsync`` you mostly measure the page cache (memory); with it,
    the device or file system behind the folder.
    """
    folder = Path(folder)
    total = total_mib * 2**20
    n_small = max(1, total // (small_kib * 1024))
    if max_small_files is not None:
        n_small = min(n_small, max_small_files)
    results = []
    for fsync in fsync_options:
        for n_files, size, label in (
            (1, total, f"1 x {total_mib} MiB"),
            (n_small, small_kib * 1024, f"{n_small} x {small_kib} KiB"),
        ):
            work = Path(tempfile.mkdtemp(prefix=".course-io-", dir=folder))
            try:
                seconds = _write_files(work, n_files, size, fsync)
                read_s = _read_files(work, n_files) if read_back and fsync else None
            finally:
                shutil.rmtree(work, ignore_errors=True)
            mib = n_files * size / 2**20
            results.append(WriteResult(name, str(folder), label, fsync, seconds, mib / seconds, n_files / seconds))
            if read_s is not None:
                results.append(WriteResult(name, str(folder), label, False, read_s, mib / read_s, n_files / read_s,
                                           op="read"))
    return results


def read_speed(folder: str | Path, file_bytes: int, total_bytes: int, max_files: int | None = None) -> float:
    """MiB/s reading files of ``file_bytes`` each (about ``total_bytes`` in all, at most ``max_files``
    files), written with ``fsync`` and dropped from the page cache first, as :func:`measure_writes`'s
    read rows are: the measurement behind notebook 00's exercise."""
    n_files = max(1, total_bytes // max(1, file_bytes))
    if max_files is not None:
        n_files = min(n_files, max_files)
    work = Path(tempfile.mkdtemp(prefix=".course-io-", dir=folder))
    try:
        _write_files(work, n_files, file_bytes, fsync=True)
        seconds = _read_files(work, n_files)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return n_files * file_bytes / 2**20 / seconds


def results_table(results: list[WriteResult]) -> str:
    rows = [f"{'target':10s} {'op':5s} {'pattern':18s} {'fsync':5s} {'MiB/s':>9s} {'files/s':>10s}"]
    for r in results:
        files = f"{r.files_per_s:10,.0f}" if not r.pattern.startswith("1 x") else f"{'-':>10s}"
        fsync = ("yes" if r.fsync else "no") if r.op == "write" else "-"
        rows.append(f"{r.target:10s} {r.op:5s} {r.pattern:18s} {fsync:5s} {r.mib_per_s:9.1f} {files}")
    return "\n".join(rows)
