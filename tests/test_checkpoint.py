"""Atomic checkpoints: a job killed mid-write leaves the previous checkpoint readable."""

import shutil
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from course_utils.checkpoint import ensure_writable_dir, load_checkpoint, save_checkpoint
from course_utils.waiting import wait_until


def test_round_trip_and_map_location(tmp_path):
    state = {"w": torch.arange(10.0), "epoch": 3}
    path = save_checkpoint(state, tmp_path / "ck" / "last.pt")
    loaded = load_checkpoint(path, map_location="cpu")
    assert torch.equal(loaded["w"], state["w"]) and loaded["epoch"] == 3
    assert [p.name for p in path.parent.iterdir()] == ["last.pt"]  # no temp files left


def test_kill_mid_write_keeps_old_checkpoint(tmp_path):
    path = tmp_path / "last.pt"
    save_checkpoint({"w": torch.full((1000,), 1.0), "epoch": 1}, path)
    marker = tmp_path / "writing"
    # A child process starts writing a new checkpoint and blocks half-way
    # through pickling; we SIGKILL it there, as Slurm would at the time limit.
    child = textwrap.dedent(
        f"""
        import pathlib, time, torch
        from course_utils.checkpoint import save_checkpoint

        class Stall:
            def __reduce__(self):
                pathlib.Path({str(marker)!r}).touch()
                time.sleep(600)
                return (int, (0,))

        save_checkpoint({{"w": torch.full((1_000_000,), 2.0), "stall": Stall(), "epoch": 2}},
                        {str(path)!r})
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", child])
    try:
        def writing() -> bool:
            assert proc.poll() is None, "the writer exited before reaching the stall"
            return marker.exists()

        wait_until(writing, 60, "the writer never started writing", interval_s=0.05)
        temps = [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]
        assert temps, "the new checkpoint was being written to a temporary file"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    old = load_checkpoint(path)
    assert old["epoch"] == 1 and torch.equal(old["w"], torch.full((1000,), 1.0))
    # and the next save replaces it cleanly
    save_checkpoint({"epoch": 3}, path)
    assert load_checkpoint(path)["epoch"] == 3


def test_unwritable_folder_is_reported_before_training(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with pytest.raises(PermissionError, match="not writable"):
        ensure_writable_dir(blocker / "ckpt", "checkpoint folder")


def test_read_only_folder():
    """A folder the process may not write into. Root may write anywhere, so as root (CI) the check
    runs in a child process that has given up root for the unprivileged user nobody."""
    import subprocess
    import sys
    import tempfile

    from course_utils.paths import child_env

    top = Path(tempfile.mkdtemp(prefix="course-ro-", dir="/tmp"))
    try:
        top.chmod(0o755)
        ro = top / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        code = ("import os, sys; from course_utils.checkpoint import ensure_writable_dir\n"
                "if os.geteuid() == 0:  # give up root once Python and the course are loaded\n"
                "    os.setgroups([]); os.setgid(65534); os.setuid(65534)\n"
                "try:\n    ensure_writable_dir(sys.argv[1], 'checkpoint folder')\n"
                "except PermissionError as exc:\n    print(exc); sys.exit(3)\n")
        run = subprocess.run([sys.executable, "-c", code, str(ro / "ckpt")], capture_output=True, text=True,
                             env=child_env(), timeout=60)
        assert run.returncode == 3, run.stdout + run.stderr
        assert f"the checkpoint folder {ro / 'ckpt'} is not writable (Permission denied)" in run.stdout
    finally:
        ro.chmod(0o755)
        shutil.rmtree(top, ignore_errors=True)


def test_the_random_streams_survive_a_trip_through_json():
    """Sharded checkpoints keep their progress as JSON (train_fsdp.py, train_pipeline.py --train): the
    random streams saved there continue exactly where they stopped, so a resumed epoch draws the
    augmentation an uninterrupted one would."""
    import json
    import random

    import numpy as np
    import torch

    from course_utils.rng import rng_state_json, set_rng_state_json

    torch.manual_seed(5), random.seed(5), np.random.seed(5)
    torch.rand(3), np.random.rand(2), random.random(), np.random.randn()  # numpy now holds a cached Gaussian
    saved = json.loads(json.dumps(rng_state_json()))
    ahead = (torch.rand(4), np.random.randn(3), random.random())
    torch.manual_seed(0), random.seed(0), np.random.seed(0)  # elsewhere
    set_rng_state_json(saved)
    again = (torch.rand(4), np.random.randn(3), random.random())
    assert torch.equal(ahead[0], again[0]) and np.array_equal(ahead[1], again[1]) and ahead[2] == again[2]
