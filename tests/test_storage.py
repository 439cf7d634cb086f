"""The storage lesson's measurement: capped on shared file systems, and it cleans up after itself."""

from course_utils.storage import SHARED_SMALL_FILES, measure_writes, small_file_cap


def test_shared_folders_get_a_capped_small_file_test(tmp_path):
    assert small_file_cap("$TMPDIR") is None, "the node's own disk takes the full test"
    assert small_file_cap("cwd") == small_file_cap("$LUSTRE") == SHARED_SMALL_FILES
    rows = measure_writes("cwd", tmp_path, total_mib=1, small_kib=1, fsync_options=(False,), max_small_files=64)
    big, small = rows
    assert (big.pattern, small.pattern) == ("1 x 1 MiB", "64 x 1 KiB"), "the shared folder's cap: 64 files"
    assert not list(tmp_path.iterdir()), "the test leaves nothing behind"


def test_reading_back_measures_the_epochs_side(tmp_path):
    rows = measure_writes("cwd", tmp_path, total_mib=1, small_kib=16, fsync_options=(True,), read_back=True)
    reads = [r for r in rows if r.op == "read"]
    assert [r.pattern for r in reads] == ["1 x 1 MiB", "64 x 16 KiB"], "each pattern read back after its write"
    assert not list(tmp_path.iterdir())
