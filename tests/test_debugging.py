"""Notebook 11's tools, with their mechanism off: without TORCH_DISTRIBUTED_DEBUG=DETAIL nothing names the mismatched
collectives, and without the flight recorder the ranks' records hold nothing. (With both on: the notebook.)"""

import pytest

from course_utils.flight_records import read_debug_server, read_flight_records
from course_utils.launch import run_script
from course_utils.process_group import free_port


def test_without_detail_or_the_recorder_a_mismatch_names_nothing(tmp_path):
    run = run_script("faulty_ddp.py", ["--mismatch-rank", 0, "--mismatch-step", 3, "--dump-dir", tmp_path,
                                       "--device", "cpu"], nproc=2, timeout_s=120, check=False, echo=False,
                     env={"COURSE_DIST_TIMEOUT": "5", "TORCH_FR_BUFFER_SIZE": "0", "TORCH_DISTRIBUTED_DEBUG": "OFF"})
    assert run.returncode != 0, run.output[-2000:]
    assert "Detected mismatch" not in run.output, "DETAIL was off: nothing compared the ranks' calls"
    # gloo aborts a process on the size it did not expect ("Received data size doesn't match"), or a peer times out
    assert "doesn't match" in run.output or "Timed out" in run.output or "Connection" in run.output, run.output[-2000:]
    records = read_flight_records(tmp_path) if any(tmp_path.iterdir()) else {}
    assert all(entries == [] for entries in records.values()), f"the recorder was off, yet recorded: {records}"


def test_no_records_says_what_to_set(tmp_path):
    with pytest.raises(FileNotFoundError, match="TORCH_FR_DUMP_TEMP_FILE"):
        read_flight_records(tmp_path)


def test_no_debug_server_says_what_to_call():
    with pytest.raises(TimeoutError, match="start_debug_server"):
        read_debug_server(free_port(), wait_s=1)
