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

import contextlib
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .hardware import threads_per_rank
from .paths import REPO_ROOT, SCRIPTS, child_env
from .show import command_line
from .waiting import wait_until


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


@contextlib.contextmanager
def environment_kept() -> Iterator[None]:
    """This process's environment, after the block, as it was before it, whatever the block wrote (Lightning's
    in-kernel launcher sets MASTER_PORT in the kernel, and every later script would inherit it)."""
    before = dict(os.environ)
    try:
        yield
    finally:
        for key in set(os.environ) - set(before):
            del os.environ[key]
        os.environ.update(before)


@contextlib.contextmanager
def temporary_env(variables: Mapping[str, str]) -> Iterator[None]:
    """Set ``variables`` in this process's environment inside the block only.

    A notebook kernel's environment is handed to every script it launches later (:func:`child_env`):
    what a library must read at import time is set around the import and taken back after it.
    """
    before = {k: os.environ.get(k) for k in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def torchrun_command(nproc: int) -> list[str]:
    """``torchrun`` for N processes on this machine, as a learner types it: ``--standalone`` lets the agent take a
    port free at that moment for its store (``localhost:0``), so runs side by side never collide."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]


def run_script(script: str | Path, args: Sequence[str] = (), nproc: int | None = None, timeout_s: float = 600,
               env: dict[str, str] | None = None, check: bool = True, echo: bool = True,
               cwd: str | Path | None = None) -> RunResult:
    """Run ``scripts/<script>`` with ``args``; under torchrun when ``nproc`` is given.

    The command is printed first, as a learner types it; the output is streamed line by line (``echo``) and
    returned. On timeout or
    ``KeyboardInterrupt`` the process group gets SIGTERM, then SIGKILL.
    With ``check`` a non-zero exit raises :class:`LaunchError`.
    """
    return start_script(script, args, nproc, env=env, echo=echo, cwd=cwd).wait(timeout_s, check)


def run_command(cmd: Sequence[str], timeout_s: float = 600, env: dict[str, str] | None = None, check: bool = True,
                echo: bool = True, cwd: str | Path | None = None) -> RunResult:
    """Run any command with the guarantees of :func:`run_script`."""
    return Process(cmd, env=env, echo=echo, cwd=cwd).wait(timeout_s, check)


def start_script(script: str | Path, args: Sequence[str] = (), nproc: int | None = None,
                 torchrun_args: Sequence[str] = (), env: dict[str, str] | None = None,
                 echo: bool = False, cwd: str | Path | None = None) -> Process:
    """Like :func:`run_script`, without waiting; ``torchrun_args`` e.g. ``["--max-restarts=1"]``."""
    path = script_path(str(script))
    prefix = [*torchrun_command(nproc), *torchrun_args] if nproc else [sys.executable]
    return Process([*prefix, str(path), *later_flags_win(args)], env=_threads_per_rank(nproc, env), echo=echo,
                   cwd=cwd)


def later_flags_win(args: Sequence[object]) -> list[str]:
    """``args`` without the earlier of two ``--flag value`` pairs of the same flag (``--epochs 2 ... --epochs 1``
    keeps ``--epochs 1``): argparse takes the last one anyway, and the command printed is the one a learner would
    type. Only a flag followed by one value each time is touched (a list, ``--ops a b``, is left as it is)."""
    args = [str(a) for a in args]

    def one_value(i: int) -> bool:
        return i + 1 < len(args) and not args[i + 1].startswith("--") and (
            i + 2 == len(args) or args[i + 2].startswith("--"))

    keep, seen = [True] * len(args), {}
    for i, arg in enumerate(args):
        if arg.startswith("--") and len(arg) > 2 and one_value(i):
            if arg in seen:
                keep[seen[arg]] = keep[seen[arg] + 1] = False
            seen[arg] = i
    return [a for a, k in zip(args, keep) if k]


def _threads_per_rank(nproc: int | None, env: dict[str, str] | None) -> dict[str, str] | None:
    """Share the cores between ranks instead of oversubscribing them (unless told otherwise)."""
    if nproc and "OMP_NUM_THREADS" not in os.environ and "OMP_NUM_THREADS" not in (env or {}):
        return {**(env or {}), "OMP_NUM_THREADS": str(threads_per_rank(nproc))}
    return env


# Lines kept in a run's output but not shown as it runs: the RESULT line is for the code that reads the run (the
# notebook prints what it means), and kineto's start-up lines on a machine without a GPU say nothing to a learner.
STATUS_EVERY_S = 30  # a run whose output is not shown says how long it has run, and its last line, this often


def shown(line: str) -> bool:
    """Whether a run's output line is shown as it runs (every line stays in its output)."""
    return not (line.startswith(("RESULT ", "USDT:")) or "gpuGetDeviceCount failed" in line)


class Process:
    """A command running in a process group of its own, its output collected line by line.

    :meth:`wait` streams the output (``echo``) from the caller's thread, so in a
    notebook it lands in the cell that waits; on its deadline or the notebook's
    stop button the whole tree is killed. Without waiting, a demo can act on the
    running job (kill a worker, send a signal) and :meth:`kill` it.
    """

    def __init__(self, cmd: Sequence[str], env: dict[str, str] | None = None, echo: bool = False,
                 cwd: str | Path | None = None) -> None:
        self.cmd = list(map(str, cmd))
        self.echo = echo
        # the command a learner would type, before any output (shown or not): every launch says what it ran
        print("$ " + command_line(self.cmd, env), flush=True)
        self.start = time.perf_counter()
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=child_env(env), cwd=str(cwd or REPO_ROOT),
                                     start_new_session=True,  # its own group: the whole tree can be killed
                                     text=True, errors="replace")
        self.chunks: list[str] = []
        self._unshown: queue.SimpleQueue[str] = queue.SimpleQueue()
        self.reader = threading.Thread(target=self._pump, daemon=True)
        self.reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.chunks.append(line)
            if self.echo and shown(line):
                self._unshown.put(line)
        self.proc.stdout.close()

    def _show(self, block_s: float = 0.0) -> None:
        """Print what arrived, waiting up to ``block_s`` for a first line."""
        try:
            line = self._unshown.get(timeout=block_s) if block_s > 0 else self._unshown.get_nowait()
            while True:
                print(line, end="", flush=True)
                line = self._unshown.get_nowait()
        except queue.Empty:
            pass

    @property
    def output(self) -> str:
        return "".join(self.chunks)

    def running(self) -> bool:
        return self.proc.poll() is None

    def wait(self, timeout_s: float = 600, check: bool = True) -> RunResult:
        """Wait up to ``timeout_s`` for the end; the result, or :class:`LaunchError`."""
        from .progress import StatusLine

        deadline = time.monotonic() + timeout_s
        timed_out = False
        name = next((Path(a).name for a in self.cmd if a.endswith(".py")), Path(self.cmd[0]).name if self.cmd else "")
        status, next_status = StatusLine(), STATUS_EVERY_S
        try:
            with status:  # a long run not shown line by line: how long so far, and its last line (then gone)
                while self.proc.poll() is None:
                    if time.monotonic() > deadline:
                        timed_out = True
                        self.kill()
                        break
                    if self.echo:
                        self._show(block_s=0.2)
                        continue
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        self.proc.wait(timeout=0.2)
                    if (ran := time.perf_counter() - self.start) >= next_status:
                        next_status = ran + STATUS_EVERY_S
                        last = next((line.strip() for line in reversed(self.chunks[-50:])
                                     if shown(line) and line.strip()), "")
                        status(f"{name}: running for {ran:.0f} s"
                               + (f"; its last line: {last[:160]}" if last else ""))
        except KeyboardInterrupt:  # the notebook's stop button
            self.kill()
            raise
        self.reader.join(timeout=10)
        self._show()
        result = RunResult(self.cmd, self.proc.returncode, self.output, time.perf_counter() - self.start, timed_out)
        if timed_out:
            raise LaunchError(f"{name} did not finish within {timeout_s:.0f} s and was killed (with all its "
                              f"processes). Last output:\n{_tail(result.output)}", result)
        if check and result.returncode != 0:
            raise LaunchError(f"command exited with code {result.returncode}: {' '.join(self.cmd)}\n"
                              f"Last output:\n{_tail(result.output)}", result)
        return result

    def kill(self, grace_s: float = 5.0) -> None:
        """SIGTERM the process group, then SIGKILL whatever is still there."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=grace_s)
                break
            except subprocess.TimeoutExpired:
                continue
        try:  # the leader is gone, but its children may linger in the group
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _tail(text: str, n: int = 80) -> str:
    # long enough to show a rank's own error above torchrun's failure summary
    return "\n".join(text.splitlines()[-n:])


def find_rank_pid(marker: str, rank: int) -> int | None:
    """PID of the worker with ``RANK=rank`` whose command line contains ``marker``, not the torchrun
    agent's (psutil: Linux and macOS alike)."""
    import psutil

    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline = " ".join(proc.info["cmdline"] or [])
            if marker in cmdline and "torch.distributed.run" not in cmdline \
                    and proc.environ().get("RANK") == str(rank):
                return proc.pid
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return None


# An elastic node is dead to the others after KEEP_ALIVE_MISSES missed heartbeats, one every KEEP_ALIVE_S
# seconds; torch's default interval, TORCH_KEEP_ALIVE_S, made a survivor wait 15 s before re-forming the group.
KEEP_ALIVE_S, KEEP_ALIVE_MISSES, TORCH_KEEP_ALIVE_S = 2, 3, 5
# How long an agent that has its minimum of nodes waits for more (the rendezvous' last call), also how long a survivor
# waits before it carries on alone. Long enough for a node started a moment later to import torch and join the first
# group (on a busy 2-core machine, 5 s was not): a node that arrives after the group formed is a scale-up, and torch's
# re-rendezvous then waits on itself until the store times out and every agent fails (torch 2.11 and 2.14 alike,
# reproduced with a plain script; see the comments of pytorch#123678).
LAST_CALL_S = 15


def start_elastic_node(script: str | Path, args: Sequence[str], endpoint: str, rdzv_id: str,
                       nnodes: str = "1:2", nproc: int = 1, max_restarts: int = 3,
                       env: dict[str, str] | None = None) -> Process:
    """One torchrun agent of an elastic job (``--nnodes=min:max``): start one per node.

    When a node dies, the others re-form the group with fewer nodes (down to
    ``min``) and restart their workers, which resume from the last checkpoint.
    """
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nnodes}", f"--nproc-per-node={nproc}",
           f"--max-restarts={max_restarts}", "--rdzv-backend=c10d", f"--rdzv-endpoint={endpoint}",
           # last call: see LAST_CALL_S; keep-alive: see KEEP_ALIVE_S
           f"--rdzv-id={rdzv_id}", f"--rdzv-conf=join_timeout=30,last_call_timeout={LAST_CALL_S},"
           f"keep_alive_interval={KEEP_ALIVE_S},keep_alive_max_attempt={KEEP_ALIVE_MISSES}",
           str(script_path(str(script))), *map(str, args)]
    return Process(cmd, env=_threads_per_rank(nproc, env))


def wait_for_port(host: str, port: int, timeout_s: float = 60) -> None:
    """Block until something listens on ``host:port`` (e.g. a rendezvous store)."""

    def listening() -> bool:
        try:
            with socket.create_connection((host, port), timeout=1):
                return True
        except OSError:
            return False

    wait_until(listening, timeout_s, f"nothing listened on {host}:{port} within {timeout_s:.0f} s")
