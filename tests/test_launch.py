"""Launcher tests: scripts run as real processes, alone and under a real torchrun/gloo group."""

import importlib.util
import os
import subprocess
import sys
import time

import pytest

from course_utils.launch import LaunchError, environment_kept, run_command, run_script
from course_utils.paths import SCRIPTS


def test_bad_cli_values_are_argparse_errors(capsys):
    """One bad value through the real program (exit 2, no traceback); the others through its own parser here."""
    run = run_script("train.py", ["--epochs", "0"], check=False, echo=False, timeout_s=120)
    assert run.returncode == 2
    assert "must be >= 1" in run.output and "Traceback" not in run.output
    spec = importlib.util.spec_from_file_location("train_for_its_parser", SCRIPTS / "train.py")
    train = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train)
    for args, expected in ((["--precision", "fp8"], "invalid choice"), (["--dataset", "imagenet"], "invalid choice"),
                           (["--lr", "-1"], "must be > 0")):
        with pytest.raises(SystemExit) as stopped:
            train.build_parser().parse_args(args)
        assert stopped.value.code == 2 and expected in capsys.readouterr().err, args


def test_missing_dataset_names_the_login_node_command(tmp_path):
    run = run_script("train.py", ["--dataset", "cifar10", "--data-root", tmp_path],
                     check=False, echo=False, timeout_s=120)
    assert run.returncode == 2 and "Traceback" not in run.output
    assert f"python -m course_utils.data download cifar10 --root {tmp_path}" in run.output


def test_cuda_without_gpu_is_one_clear_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = run_script("train.py", ["--device", "cuda"], check=False, echo=False, timeout_s=120)
    assert run.returncode != 0 and "Traceback" not in run.output
    assert "no CUDA GPU is visible" in run.output


def test_cuda_without_gpu_under_torchrun_stops_every_rank_with_the_same_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    run = run_script("train.py", ["--device", "cuda"], nproc=2, check=False, echo=False, timeout_s=120)
    assert run.returncode != 0
    # rank 0 placed both ranks at the rendezvous; each rank reports the one decision, then stops
    assert run.output.count("error: --device cuda was asked for, but no CUDA GPU is visible to rank(s) 0, 1") == 2


def test_unwritable_checkpoint_folder_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    start = time.perf_counter()
    run = run_script("train.py", ["--ckpt-dir", blocker / "ckpt"], check=False, echo=False, timeout_s=120)
    assert run.returncode == 2 and "not writable" in run.output
    assert "epoch 0" not in run.output and "Traceback" not in run.output
    assert time.perf_counter() - start < 60


def test_timeout_kills_the_whole_process_tree(tmp_path):
    pid_file = tmp_path / "child.pid"
    code = (
        "import subprocess, sys, time, pathlib;"
        "c = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)']);"
        f"pathlib.Path({str(pid_file)!r}).write_text(str(c.pid));"
        "print('started', flush=True); time.sleep(300)"
    )
    with pytest.raises(LaunchError, match="did not finish within 3 s") as err:
        run_command([sys.executable, "-c", code], timeout_s=3, echo=False)
    assert err.value.result.timed_out and "started" in err.value.result.output
    child = int(pid_file.read_text())
    for _ in range(50):  # the grandchild must be gone too, not orphaned
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a zombie still answers kill(0); it is dead when its state is Z
        with open(f"/proc/{child}/stat") as fh:
            if fh.read().split()[2] == "Z":
                break
        time.sleep(0.1)
    else:
        pytest.fail(f"grandchild {child} survived the timeout")


def test_failing_command_raises_with_its_output():
    with pytest.raises(LaunchError, match="exited with code 3") as err:
        run_command([sys.executable, "-c", "print('boom'); raise SystemExit(3)"], echo=False)
    assert "boom" in str(err.value)


def test_launched_scripts_find_course_utils_without_an_install():
    # A portal kernel may have torch but not this package installed. With -S
    # (no site-packages, so no editable install) only PYTHONPATH can find it.
    code = "import importlib.util as u; print(u.find_spec('course_utils').origin)"
    run = run_command([sys.executable, "-S", "-c", code], env={"PYTHONPATH": "/elsewhere"},
                      echo=False, timeout_s=60)
    assert run.output.strip().endswith("notebooks/course_utils/__init__.py")


def test_data_cli_help_runs():
    out = subprocess.run([sys.executable, "-m", "course_utils.data", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "download" in out.stdout


def test_wait_until_returns_the_answer_or_raises_what_was_still_missing():
    from course_utils.waiting import wait_until

    calls = []
    assert wait_until(lambda: calls.append(1) or (len(calls) >= 3 and "ready"), 5, "never", interval_s=0.01) == "ready"
    missing = ["rank 1"]
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"still missing: \['rank 1'\]"):
        wait_until(lambda: not missing, 0.2, lambda: RuntimeError(f"still missing: {missing}"), interval_s=0.01)
    assert 0.2 <= time.monotonic() - start < 5
    with pytest.raises(TimeoutError, match="nothing came"):
        wait_until(lambda: None, 0, "nothing came")


def test_lab_on_a_compute_node_binds_loopback_on_a_free_port_and_prints_its_tunnel():
    import re

    run = run_script("lab_on_node.py", ["--dry-run", "--login", "ft3.cesga.es", "--user", "alice"],
                     echo=False, timeout_s=60)
    tunnel = re.search(r"ssh -N -L (\d+):127\.0\.0\.1:(\d+) -J alice@ft3\.cesga\.es alice@(\S+)", run.output)
    assert tunnel and tunnel.group(1) == tunnel.group(2), run.output
    command = next(line for line in run.lines if line.startswith("command: "))
    assert f"--port={tunnel.group(1)}" in command and "--ip=127.0.0.1" in command
    assert "token=''" not in command and "--ServerApp.token" not in command, "Jupyter's token stays on"


def test_what_a_library_writes_into_the_kernel_s_environment_is_taken_back(monkeypatch):
    """As Lightning's in-kernel launcher does: it sets MASTER_PORT (and could change a variable already there)."""
    monkeypatch.setenv("COURSE_TEST_KEPT", "before")
    monkeypatch.delenv("MASTER_PORT", raising=False)
    before = dict(os.environ)
    with environment_kept():
        os.environ["MASTER_PORT"] = "29500"
        os.environ["COURSE_TEST_KEPT"] = "changed"
        del os.environ["COURSE_TEST_KEPT"]
    assert dict(os.environ) == before


def test_a_run_s_command_is_shown_as_a_person_types_it_and_a_missing_line_is_an_error():
    """course_utils.show: what the notebooks put on the page is read from what ran."""
    from course_utils.paths import REPO_ROOT
    from course_utils.show import command_line, show_lines

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", str(REPO_ROOT / "scripts" / "whoami.py"),
           "--flag", "two words"]
    assert command_line(cmd) == "torchrun --nproc-per-node=2 scripts/whoami.py --flag 'two words'"
    with pytest.raises(ValueError, match="plain_ddp.py has no line containing 'no such line'"):
        show_lines("plain_ddp.py", "no such line")


def test_a_rank_s_worker_is_found_by_its_environment_and_the_agent_is_not(tmp_path):
    """find_rank_pid (psutil): the process whose command line holds the marker and whose RANK is asked for; not
    another rank's, not a torchrun agent's with the same marker."""
    import subprocess
    import sys

    from course_utils.launch import find_rank_pid

    marker = str(tmp_path / "marker")
    sleep = [sys.executable, "-c", "import time; time.sleep(30)"]
    procs = {name: subprocess.Popen([*sleep, marker, *extra], env={**os.environ, "RANK": rank})
             for name, rank, extra in (("rank 0", "0", []), ("agent", "1", ["torch.distributed.run"]),
                                       ("rank 1", "1", []))}
    try:
        assert find_rank_pid(marker, rank=1) == procs["rank 1"].pid
        assert find_rank_pid(marker, rank=0) == procs["rank 0"].pid
        assert find_rank_pid(marker, rank=2) is None
    finally:
        for p in procs.values():
            p.kill()
            p.wait()


def test_a_later_flag_replaces_an_earlier_one_in_the_command_that_runs():
    """The printed command is the one that runs: `--epochs 2 ... --epochs 1` runs (and shows) `--epochs 1` alone,
    as argparse would read it; switches, lists and values that look like numbers are left as they are."""
    from course_utils.launch import later_flags_win

    assert later_flags_win(["--model", "mlp", "--epochs", 2, "--lr", "1e-3", "--epochs", 1]) == [
        "--model", "mlp", "--lr", "1e-3", "--epochs", "1"]
    assert later_flags_win(["--no-progress", "--seed", "-1", "--no-progress"]) == ["--no-progress", "--seed", "-1",
                                                                                 "--no-progress"]
    assert later_flags_win(["--ops", "a", "b", "--ops", "c"]) == ["--ops", "a", "b", "--ops", "c"]


def test_a_long_run_not_shown_says_how_long_it_has_run_and_its_last_line(monkeypatch, capsys):
    """echo=False hides a run's output; past STATUS_EVERY_S the wait says how long it has run and its last line
    (a status line: in place in a notebook, a printed line here), and a shorter run says nothing but its command."""
    from course_utils import launch

    script = "import time; print('epoch 1: loss 2.0', flush=True); time.sleep(1.2)"
    monkeypatch.setattr(launch, "STATUS_EVERY_S", 0.5)
    launch.run_command([sys.executable, "-c", script], echo=False, timeout_s=30)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("$ ") and len(lines) >= 2, lines
    assert all(line.endswith("s; its last line: epoch 1: loss 2.0") and "running for" in line for line in lines[1:])
    monkeypatch.setattr(launch, "STATUS_EVERY_S", 30)
    launch.run_command([sys.executable, "-c", script], echo=False, timeout_s=30)
    assert len(capsys.readouterr().out.splitlines()) == 1, "a run shorter than the interval: only its command"
