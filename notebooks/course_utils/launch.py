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
from .hardware import usable_cores

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
    env = _threads_per_rank(nproc, env)
    cmd = [*prefix, str(path), *map(str, args)]
    return run_command(cmd, timeout=timeout, env=env, check=check, echo=echo, cwd=cwd)


def _threads_per_rank(nproc: int | None, env: dict[str, str] | None) -> dict[str, str] | None:
    """Share the cores between ranks instead of oversubscribing them (unless told otherwise)."""
    if nproc and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in (env or {}):
        # the cores this process may use (a Slurm cgroup, a portal's quota), not the node's
        return {**(env or {}), "OMP_NUM_THREADS": str(max(1, usable_cores() // nproc))}
    return env


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


class Background:
    """A script started without waiting: for demos that act on a running job
    (kill a worker, send a signal). Output is collected by a thread; ``wait()``
    returns a :class:`RunResult`; the whole process group dies on ``kill()``."""

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, echo: bool = False) -> None:
        import threading

        self.cmd = list(map(str, cmd))
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=child_env(env), cwd=str(REPO_ROOT),
                                     start_new_session=True, text=True, errors="replace")
        self.chunks: list[str] = []

        def pump() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                self.chunks.append(line)
                if echo:
                    print(line, end="", flush=True)

        self.reader = threading.Thread(target=pump, daemon=True)
        self.reader.start()

    @property
    def output(self) -> str:
        return "".join(self.chunks)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout: float = 600, check: bool = True) -> RunResult:
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise LaunchError(f"did not finish within {timeout:.0f} s and was killed. Last output:\n"
                              f"{_tail(self.output)}", self.result(timed_out=True)) from None
        self.reader.join(timeout=10)
        result = self.result()
        if check and result.returncode != 0:
            raise LaunchError(f"exited with code {result.returncode}. Last output:\n{_tail(self.output)}", result)
        return result

    def result(self, timed_out: bool = False) -> RunResult:
        return RunResult(self.cmd, self.proc.returncode if self.proc.returncode is not None else -1,
                         self.output, time.perf_counter() - self.start, timed_out)

    def kill(self) -> None:
        _kill_group(self.proc)


def start_script(script: str | Path, args: Sequence[str] = (), nproc: int | None = None,
                 torchrun_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 echo: bool = False) -> Background:
    """Like :func:`run_script`, without waiting; ``torchrun_args`` e.g. ``["--max-restarts=1"]``."""
    path = script_path(str(script))
    prefix = [*torchrun_command(nproc), *torchrun_args] if nproc else [sys.executable]
    return Background([*prefix, str(path), *map(str, args)], env=_threads_per_rank(nproc, env), echo=echo)


def find_rank_pid(marker: str, rank: int) -> int | None:
    """PID of the worker with ``RANK=rank`` whose command line contains ``marker``
    (Linux /proc), not the torchrun agent's."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if marker.encode() in cmdline and b"torch.distributed.run" not in cmdline \
                and f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


def start_elastic_node(script: str | Path, args: Sequence[str], endpoint: str, rdzv_id: str,
                       nnodes: str = "1:2", nproc: int = 1, max_restarts: int = 3,
                       env: dict[str, str] | None = None) -> Background:
    """One torchrun agent of an elastic job (``--nnodes=min:max``): start one per node.

    When a node dies, the others re-form the group with fewer nodes (down to
    ``min``) and restart their workers, which resume from the last checkpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
           f"--rdzv-id={rdzv_id}", "--rdzv-conf=join_timeout=30,last_call_timeout=2",
           str(script_path(str(script))), *map(str, args)]
    return Background(cmd, env=_threads_per_rank(nproc, env))


def wait_for_port(host: str, port: int, timeout: float = 60) -> None:
    """Block until something listens on ``host:port`` (e.g. a rendezvous store)."""
    import socket

    deadline = time.perf_counter() + timeout
    while True:
        try:
            with socket.create_connection((host, port), timeout=1):
                return
        except OSError:
            if time.perf_counter() > deadline:
                raise TimeoutError(f"nothing listened on {host}:{port} within {timeout:.0f} s") from None
            time.sleep(0.1)
