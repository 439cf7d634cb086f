"""Real process groups (torchrun + gloo): the guarantees notebooks 02-03 teach."""

import os
import socket
import subprocess
import sys
import threading
import time

from course_utils.process_group import free_port
from course_utils.launch import run_script
from course_utils.paths import child_env
from course_utils.paths import REPO_ROOT
from course_utils.results import parse_result


def test_hand_written_ring_of_two_equals_all_reduce():
    """A ring of two ranks, the edge case (notebook 02 checks the ring on three in its benchmark)."""
    run = run_script("allreduce_bench.py", ["--check-only"], nproc=2, timeout_s=300, echo=False)
    result = parse_result(run.output)
    assert result["world_size"] == 2
    assert result["ring_int_exact"], "integer sums must match exactly"
    assert result["ring_max_rel_diff"] < 1e-12


def test_two_torchrun_jobs_at_once_do_not_clash():
    results, errors = {}, []

    def job(i):
        try:
            results[i] = run_script("collectives_demo.py", ["--ops", "all_reduce", "broadcast", "barrier"],
                                    nproc=2, timeout_s=300, echo=False)
        except Exception as exc:  # collected, asserted below
            errors.append(exc)

    threads = [threading.Thread(target=job, args=(i,)) for i in range(2)]  # a clash needs two
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for run in results.values():
        assert all(parse_result(run.output)["checks"].values())


def _alive_with_marker(marker: str) -> list[int]:
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as fh:
                    if marker.encode() in fh.read():
                        pids.append(int(pid))
            except OSError:
                pass
    return pids


def _start_alone(rank: int, world: int, port: int, marker: str, extra_env: dict | None = None):
    env = child_env({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": "0",
                     "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), **(extra_env or {})})
    for var in ("COURSE_JOIN_TIMEOUT", "TORCHELASTIC_USE_AGENT_STORE"):
        if var not in (extra_env or {}):
            env.pop(var, None)
    cmd = [sys.executable, str(REPO_ROOT / "scripts" / "train.py"), "--epochs", "1", "--workers", "0",
           "--log-dir", f"/tmp/{marker}"]
    start = time.monotonic()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    return out, time.monotonic() - start


def test_missing_peer_fails_at_the_join_timeout_naming_it():
    port, marker = free_port(), f"course-missing-peer-{os.getpid()}"
    # a short join timeout (the default, 45 s, is $COURSE_JOIN_TIMEOUT's): rank 0 waits it out, then names rank 1
    out, seconds = _start_alone(0, 2, port, marker, {"COURSE_JOIN_TIMEOUT": "3"})
    message = out.stderr + out.stdout
    assert out.returncode != 0 and 3 <= seconds < 60, (seconds, message[-2000:])
    assert "rank(s) 1 of 2 never joined" in message and f"127.0.0.1:{port}" in message
    assert "Traceback" not in message
    assert _alive_with_marker(marker) == [], "no process may be left behind"
    with socket.socket() as s:  # the rendezvous port is free again
        s.bind(("127.0.0.1", port))


def test_worker_without_rank_zero_names_the_address():
    port, marker = free_port(), f"course-missing-master-{os.getpid()}"
    out, seconds = _start_alone(1, 2, port, marker, {"COURSE_JOIN_TIMEOUT": "2"})
    message = out.stderr + out.stdout
    assert out.returncode != 0 and seconds < 60
    assert f"could not reach rank 0's rendezvous at 127.0.0.1:{port}" in message
    assert _alive_with_marker(marker) == []
