"""Run the course's scripts from a notebook as real subprocesses.

Multiprocessing from inside a Jupyter kernel is fragile (``spawn`` cannot
pickle functions defined in a notebook, ``fork`` copies the kernel's threads),
so notebooks start ``scripts/*.py`` -- alone or under ``torchrun`` -- exactly as
a terminal or an sbatch script would, and stream their output into the cell.

Each run gets a free rendezvous port, a timeout, and its own process group:
on timeout or interrupt (the stop button) the whole tree is killed, so no
orphaned rank keeps a GPU or a port busy.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from .dist import free_port

PACKAGE_PARENT = Path(__file__).resolve().parent.parent  # the folder holding course_utils
REPO_ROOT = PACKAGE_PARENT.parent
SCRIPTS = REPO_ROOT / "scripts"


class LaunchError(RuntimeError):
    """A launched script failed or timed out; ``.result`` has its output."""

    def __init__(self, message: str, result: RunResult) -> None:
        super().__init__(message)
        self.result = result


@dataclass
class RunResult:
    command: list[str]
    returncode: int
    output: str
    seconds: float
    timed_out: bool = False

    @property
    def lines(self) -> list[str]:
        return self.output.splitlines()


def script_path(name: str) -> Path:
    """``"train.py"`` -> the absolute path of ``scripts/train.py``."""
    path = Path(name)
    if not path.is_absolute():
        path = SCRIPTS / name
    if not path.exists():
        raise FileNotFoundError(f"no script {path}; the course's scripts live in {SCRIPTS}")
    return path


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched script: ours, plus ``course_utils`` on
    ``PYTHONPATH`` (so it imports even where the package is not installed)."""
    env = {**os.environ, **(extra or {})}
    paths = [str(PACKAGE_PARENT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, not at exit
    return env


def torchrun_command(nproc: int, port: int | None = None) -> list[str]:
    """``torchrun`` for N processes on this machine, on a port of its own."""
    port = port or free_port()
    return [
        sys.executable, "-m", "torch.distributed.run",
        "--nnodes=1", f"--nproc-per-node={nproc}",
        "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
    ]


def run_script(
    script: str | Path,
    args: Sequence[str] = (),
    nproc: int | None = None,
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = True,
    echo: bool = True,
    cwd: str | Path | None = None,
) -> RunResult:
    """Run ``scripts/<script>`` with ``args``; under torchrun when ``nproc`` is given.

    Output is streamed line by line (``echo``) and returned. On timeout or
    ``KeyboardInterrupt`` the process group gets SIGTERM, then SIGKILL.
    With ``check`` a non-zero exit raises :class:`LaunchError`.
    """
    path = script_path(str(script))
    prefix = torchrun_command(nproc) if nproc else [sys.executable]
    if nproc and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in (env or {}):
        # share the cores between ranks instead of oversubscribing them
        env = {**(env or {}), "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // nproc))}
    cmd = [*prefix, str(path), *map(str, args)]
    return run_command(cmd, timeout=timeout, env=env, check=check, echo=echo, cwd=cwd)


def run_command(
    cmd: Sequence[str],
    timeout: float = 600,
    env: dict[str, str] | None = None,
    check: bool = True,
    echo: bool = True,
    cwd: str | Path | None = None,
) -> RunResult:
    """Run any command with the guarantees of :func:`run_script`."""
    cmd = list(map(str, cmd))
    start = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        env=child_env(env),
        cwd=str(cwd or REPO_ROOT),
        start_new_session=True,  # its own process group, so we can kill the whole tree
    )
    assert proc.stdout is not None
    chunks: list[str] = []
    timed_out = False
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    try:
        while True:
            remaining = timeout - (time.perf_counter() - start)
            if remaining <= 0:
                timed_out = True
                break
            if not sel.select(timeout=min(remaining, 1.0)):
                if proc.poll() is not None:
                    break
                continue
            line = proc.stdout.readline()
            if not line:
                break
            text = line.decode(errors="replace")
            chunks.append(text)
            if echo:
                print(text, end="", flush=True)
    except KeyboardInterrupt:  # the notebook's stop button
        _kill_group(proc)
        raise
    finally:
        sel.close()
    if timed_out:
        _kill_group(proc)
    returncode = proc.wait()
    proc.stdout.close()
    result = RunResult(cmd, returncode, "".join(chunks), time.perf_counter() - start, timed_out)
    if timed_out:
        raise LaunchError(
            f"{Path(cmd[-1]).name if cmd else cmd} did not finish within {timeout:.0f} s and was "
            f"killed (with all its processes). Last output:\n{_tail(result.output)}",
            result,
        )
    if check and returncode != 0:
        raise LaunchError(
            f"command exited with code {returncode}: {' '.join(cmd)}\nLast output:\n{_tail(result.output)}",
            result,
        )
    return result


def _tail(text: str, n: int = 80) -> str:
    # long enough to show a rank's own error above torchrun's failure summary
    return "\n".join(text.splitlines()[-n:])


def _kill_group(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM the process group, then SIGKILL whatever is still there."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            break
        except subprocess.TimeoutExpired:
            continue
    try:  # the leader is gone, but its children may linger in the group
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
