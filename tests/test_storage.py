"""The storage lesson's measurement: capped on shared file systems, and it cleans up after itself; what
data/stage.sh prints when it copies a data set to a node, read back as notebook 10 does."""

import subprocess

import pytest

from course_utils.data.formats import files_in
from course_utils.paths import REPO_ROOT
from course_utils.storage import SHARED_SMALL_FILES, measure_writes, small_file_cap, staged_copies


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


def _stage(src, dst):
    return subprocess.Popen(["bash", str(REPO_ROOT / "data" / "stage.sh"), "--copy", str(src), str(dst)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _shards(tmp_path):
    src = tmp_path / "shared" / "shards"
    (src / "train").mkdir(parents=True)
    for i in range(3):
        (src / "train" / f"shard-{i:06d}.tar").write_bytes(bytes([i]) * 200_000)
    return src


def test_every_line_stage_sh_prints_is_parsed(tmp_path):
    """Notebook 10 reads data/stage.sh's lines: a copy made (with its time) and a copy found already there."""
    src = _shards(tmp_path)
    first, again = (_stage(src, tmp_path / "local").communicate()[0] for _ in range(2))
    (made,), (found,) = staged_copies(first), staged_copies(again)
    assert made["ms"] is not None and made["ms"] >= 0 and found["ms"] is None, (first, again)
    assert made["name"] == found["name"] == "shards" and made["node"] == found["node"]
    assert made["target"] == found["target"] == str(tmp_path / "local" / "shards")
    assert staged_copies("job 7 on 2 node(s)\n" + first) == [made], "other lines of a job's log are not staging lines"
    with pytest.raises(ValueError, match="does not know"):
        staged_copies(first.replace(" ms", " seconds"))


def test_two_tasks_staging_to_one_path_leave_one_whole_copy(tmp_path):
    """The test cluster's two 'nodes' share this machine's /tmp: both tasks copy to one path at once."""
    src = _shards(tmp_path)
    tasks = [_stage(src, tmp_path / "local") for _ in range(2)]
    lines = [staged_copies(task.communicate()[0]) for task in tasks]
    assert all(task.returncode == 0 for task in tasks) and [len(found) for found in lines] == [1, 1]
    assert {found[0]["target"] for found in lines} == {str(tmp_path / "local" / "shards")}, "one folder for both"
    assert [p.name for p in (tmp_path / "local").iterdir()] == ["shards"], "the copy that lost the rename is gone"
    copied = files_in(tmp_path / "local" / "shards")
    assert [p.read_bytes() for p in copied] == [p.read_bytes() for p in files_in(src)], "and the copy is whole"
