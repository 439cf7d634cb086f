"""Every script in slurm/, submitted unchanged to a real two-node Slurm cluster.

The cluster (tests/slurm_cluster.py) is started for this module and stopped
after it; the test is skipped, with the reason, where it cannot run (not root,
not Linux). Only TRAIN_ARGS is set, through the environment, to keep the runs
small; resources, partitions and launch lines are the scripts' own.
"""

import subprocess
import time
from pathlib import Path

import pytest

from course_utils import slurm
from course_utils.dist import port_from_job_id

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted((ROOT / "slurm").glob("*/*.sbatch"))
TINY = "--model cnn --epochs 2 --n-train 256 --n-val 64 --batch-size 16 --workers 0"

slurm_cluster_module = pytest.importorskip("slurm_cluster", reason="tests/ is not on sys.path")
REASON = slurm_cluster_module.unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


@pytest.fixture(scope="module")
def cluster():
    start = time.time()
    c = slurm_cluster_module.shared()  # stopped at the end of the session (conftest.py)
    print(f"Slurm test cluster ready in {time.time() - start:.1f} s")
    return c


def expected_world(script: Path) -> int:
    text = script.read_text()
    nodes = int(text.split("--nodes=")[1].split()[0])
    if "sweep_array" in script.name:
        return 1
    gpus = 4 if "frontera" in script.parts[-2] else 2
    return nodes * gpus


def logs_of(job_id: int, records: list[dict]) -> list[Path]:
    return [Path(r["StdOut"]) for r in records]


def test_every_script_completes_with_the_expected_output(cluster):
    """All 15 scripts submitted at once (so also: many concurrent jobs), each must end COMPLETED."""
    jobs = {slurm.sbatch(s, env={"TRAIN_ARGS": TINY}): s for s in SCRIPTS if "requeue" not in s.name}
    assert len(jobs) >= 5
    records = slurm.wait(list(jobs), timeout=900)
    report = []
    for job_id, script in jobs.items():
        recs = records[job_id]
        states = {(r["JobState"], r["ExitCode"]) for r in recs}
        report.append(f"{script.relative_to(ROOT)}: job {job_id} {sorted(states)}")
        tails = [p.read_text()[-3000:] for p in logs_of(job_id, recs)]
        assert states == {("COMPLETED", "0:0")}, "\n".join([report[-1], *tails])
        for log in logs_of(job_id, recs):
            res = slurm.results_in_log(log)
            assert len(res) == 1, f"{log}: one RESULT line, from rank 0 only"
            r = res[0]
            assert r["world_size"] == expected_world(script), (script, r)
            assert r["train_loss"][-1] < r["train_loss"][0], f"{script}: the loss falls"
            assert r["ranks_agree"], f"{script}: every rank ends with the same parameters"
            nodes = int(script.read_text().split("--nodes=")[1].split()[0])
            assert len(r["hosts"]) == nodes, f"{script}: ranks ran on {r['hosts']}"
    print("\n".join(report))


def test_requeue_on_signal_resumes_from_the_checkpoint(cluster):
    script = ROOT / "slurm" / "generic" / "requeue.sbatch"
    args = "--model cnn --epochs 6 --n-train 2048 --n-val 64 --batch-size 32 --workers 0"
    job = slurm.sbatch(script, env={"TRAIN_ARGS": args, "COURSE_RUNS": str(ROOT / "runs" / "slurm-test")})
    ckpt = ROOT / "runs" / "slurm-test" / f"generic-requeue-{job}" / "ckpt" / "last.pt"
    deadline = time.time() + 300
    while not ckpt.exists():
        assert time.time() < deadline, f"no checkpoint after 300 s\n{cluster.logs()}"
        time.sleep(0.5)
    slurm.signal_batch(job, "USR1")  # what --signal=B:USR1@120 does before the time limit
    slurm.wait_requeued(job)
    slurm.release(job)  # a requeued job waits ~2 minutes before it may start again
    record = slurm.wait([job], timeout=600)[job][0]
    log = Path(record["StdOut"]).read_text()
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), log[-3000:]
    assert "requeueing job" in log and "start number 2" in log
    resumed_at = int(log.split("resumed from ")[1].split(" at epoch ")[1].split()[0])
    assert 1 <= resumed_at < 6, "the second run continued from a checkpoint, not from scratch"
    final = slurm.results_in_log(record["StdOut"])[-1]
    assert final["epochs"] == 6 and len(final["train_loss"]) == 6


def test_script_outside_slurm_says_so():
    out = subprocess.run(["bash", str(ROOT / "slurm" / "ft3" / "one_node.sbatch")], capture_output=True, text=True,
                         env={"PATH": "/usr/bin:/bin"})
    assert out.returncode != 0 and "submit it with sbatch" in out.stderr


def test_batch_port_rule_matches_python():
    lib = (ROOT / "slurm" / "lib" / "course_job.sh").read_text()
    assert "MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))" in lib
    for job in (1, 19999, 20000, 123456789):
        assert port_from_job_id(job) == 20000 + job % 20000


def test_scripts_pass_shellcheck():
    import shutil

    if shutil.which("shellcheck") is None and REASON is None:
        slurm_cluster_module.ensure_installed()
    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck)")
    out = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SCRIPTS), "slurm/lib/course_job.sh"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stdout
