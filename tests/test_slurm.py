"""Every script in slurm/, submitted unchanged to a real two-node Slurm cluster.

The cluster (slurm/practice_cluster.py) is started once for the session; the
tests are skipped, with the reason, where it cannot run (not root, not Linux).
Only TRAIN_SCRIPT and TRAIN_ARGS are set, through the environment, to keep the
runs small; resources, partitions and launch lines are the scripts' own.
"""

import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from course_utils import slurm
from course_utils.devices import RankView, place_ranks
from course_utils.launch import run_script
from course_utils.paths import REPO_ROOT
from course_utils.results import plain_epochs, plain_summary, results_in_log
from course_utils.waiting import wait_until

SCRIPTS = sorted((REPO_ROOT / "slurm").glob("*/*.sbatch"))
TINY = "--model cnn --epochs 2 --n-train 256 --n-val 64 --batch-size 16 --workers 0"
PLAIN = {"TRAIN_SCRIPT": str(REPO_ROOT / "scripts" / "plain_ddp.py"),
         "TRAIN_ARGS": "--epochs 2 --n-train 512 --batch-size 16 --workers 0"}
# The test cluster's nodes share this machine's cores: a thread per rank, not the cores Slurm grants
ONE_THREAD = {"OMP_NUM_THREADS": "1"}

slurm_cluster_module = pytest.importorskip("slurm_cluster", reason="tests/ is not on sys.path")
REASON = slurm_cluster_module.unavailable_reason()
needs_cluster = pytest.mark.skipif(REASON is not None, reason=REASON or "")

_spec = importlib.util.spec_from_file_location("slurm_generate", REPO_ROOT / "slurm" / "generate.py")
generate = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(generate)
SITES = generate.sites()


@pytest.fixture(scope="module")
def cluster():
    start = time.time()
    c = slurm_cluster_module.shared()  # stopped at the end of the session (conftest.py)
    print(f"Slurm test cluster ready in {time.time() - start:.1f} s")
    return c


def expected(script: Path) -> tuple[int, int]:
    """(world size, nodes) that ``script`` must produce (a sweep's trials: notebook 04)."""
    site, pattern = SITES[script.parent.name], script.stem
    nodes = 2 if pattern.startswith("multi_node") else 1
    return nodes * site["gpus_per_node"], nodes


def _state(job: int) -> str | None:
    """The job's state now; None where scontrol did not answer this time (a poll asks again)."""
    return (slurm.job_records(job) or [{}])[0].get("JobState")


def plain_results(log: Path) -> list[dict]:
    """What each run of plain_ddp.py in a job's log printed: its summary line and its epochs' losses."""
    runs = log.read_text().split("\ndone: ")
    return [{**plain_summary("done: " + run.splitlines()[0]), "losses": plain_epochs(previous)}
            for previous, run in zip(runs, runs[1:])]


def test_generated_scripts_are_the_committed_ones():
    out = subprocess.run(["python3", str(REPO_ROOT / "slurm" / "generate.py"), "--check"], capture_output=True,
                         text=True)
    assert out.returncode == 0, out.stderr + "\nrun: python slurm/generate.py, and commit what it writes"


def test_frontera_sweep_packs_a_trial_per_gpu_and_ft3_takes_one_gpu_per_trial():
    frontera = (REPO_ROOT / "slurm" / "frontera" / "sweep_array.sbatch").read_text()
    ft3 = (REPO_ROOT / "slurm" / "ft3" / "sweep_array.sbatch").read_text()
    assert "TRIALS_PER_TASK=4" in frontera and "#SBATCH --array=0-0" in frontera and "--gres" not in frontera
    assert "TRIALS_PER_TASK=1" in ft3 and "#SBATCH --gres=gpu:a100:1" in ft3 and "#SBATCH --array=0-3" in ft3
    # the multi-node pattern notebook 04 prints asks for both of an FT3 node's A100s
    assert "#SBATCH --gres=gpu:a100:2" in (REPO_ROOT / "slurm" / "ft3" / "multi_node_srun.sbatch").read_text()


def test_a_wait_says_where_each_job_stands_and_why_a_pending_one_waits():
    """What slurm.wait shows while it polls (on a real queue PENDING is the long part): each job's state, an
    array's tasks counted by state, Slurm's reason for the pending ones, and a job Slurm does not know."""
    records = {7: [{"JobState": "PENDING", "Reason": "Priority"}],
               8: [{"JobState": "RUNNING", "Reason": "None"}, {"JobState": "PENDING", "Reason": "Resources"},
                   {"JobState": "RUNNING", "Reason": "None"}],
               9: []}
    assert slurm.job_states(records) == ("job 7 PENDING (Priority); job 8 2 RUNNING, 1 PENDING (Resources); "
                                         "job 9 not known to Slurm")


@pytest.mark.parametrize("site", sorted(SITES))
def test_the_ray_pattern_is_one_task_per_node_and_never_stops_other_jobs_ray(site):
    """(Notebook 08 prints these lines.) One Slurm task, one Ray node, per node; and no `ray stop`,
    which would stop every Ray of the user's on the node, other jobs' too."""
    sbatch = (REPO_ROOT / "slurm" / site / "multi_node_ray.sbatch").read_text().splitlines()
    node = (REPO_ROOT / "slurm" / "lib" / "ray_node.sh").read_text().splitlines()
    commands = "\n".join(line for line in sbatch + node if not line.lstrip().startswith("#"))
    assert "#SBATCH --ntasks-per-node=1" in sbatch
    assert "ray stop" not in commands


# Where each pattern runs for real. The sites' scripts differ in their #SBATCH lines only (one template
# per pattern writes the launch lines), and every script's request is checked against the cluster with
# `sbatch --test-only` below; each pattern's launch lines then run. Notebook 04 runs generic's one_node,
# multi_node_srun and multi_node_torchrun with the course's train.py, multi_node_srun with the plain script,
# and the sweep array (each trial's flags checked); notebook 05 the requeue pattern (its resume bit for bit:
# tests/test_fault_tolerance.py); notebook 06 the Lightning pattern. The tests at the end of this file run every
# pattern again, generated for another centre's layout (the Ray pattern with a search that requeues). What no
# notebook runs with a training script runs here: the plain script under torchrun's rendezvous across nodes
# (one_node and requeue start the same torchrun on one node, and no pattern adds a flag to any script);
# DeepSpeed on two nodes; the 2-D pattern (tensor parallel inside each node, data parallel across).
RUN_HERE = {("ft3", "multi_node_deepspeed"): "course", ("generic", "multi_node_2d"): "2d"}
# the one-file torchrun job (one torchrun a node, --max-restarts) runs plain_resumable.py on 2 nodes x 2 ranks
TORCHRUN_ONE_FILE = REPO_ROOT / "slurm" / "ddp_torchrun_one_file.sbatch"
TINY_2D = "--hidden 32 --heads 2 --blocks 1 --batch 2 --seq 8 --steps 2"


@needs_cluster
@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: f"{p.parent.name}-{p.stem}")
def test_every_script_s_request_is_accepted_by_the_cluster(cluster, script):
    """sbatch --test-only: the partition, nodes, tasks, GPUs and time the script asks for exist (Slurm
    answers when the job would start), without running it."""
    out = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True, cwd=REPO_ROOT,
                         env={**os.environ, "TRAIN_ARGS": TINY})
    assert out.returncode == 0 and "to start at" in out.stderr, out.stderr


@needs_cluster
def test_the_patterns_no_notebook_runs_run_the_course_script_or_a_plain_torchrun_script(cluster):
    """The one-file torchrun job starts plain_resumable.py (it knows nothing of course_utils) with one torchrun a
    node, as a researcher's copy would. The course's DeepSpeed script runs through FT3's DeepSpeed pattern, and
    train_tp.py through the 2-D pattern: a tensor-parallel group per node, the nodes data parallel. (Any
    TRAIN_SCRIPT through every generated pattern: the launch probe's test below.)"""
    assert {(s.parent.name, s.stem) for s in SCRIPTS} >= set(RUN_HERE), "a pattern in RUN_HERE has no script"
    jobs = {}
    for (site, pattern), kind in RUN_HERE.items():
        script = REPO_ROOT / "slurm" / site / f"{pattern}.sbatch"
        args = TINY_2D if kind == "2d" else TINY
        env = {**PLAIN, **ONE_THREAD} if kind == "plain" else {"TRAIN_ARGS": args, **ONE_THREAD}
        jobs[slurm.sbatch(script, env=env)] = (script, kind)
    jobs[slurm.sbatch(TORCHRUN_ONE_FILE, env={"TRAIN_ARGS": PLAIN["TRAIN_ARGS"], **ONE_THREAD})] = \
        (TORCHRUN_ONE_FILE, "plain")
    records = slurm.wait(list(jobs), timeout_s=1200)
    for job_id, (script, kind) in jobs.items():
        recs = records[job_id]
        report = cluster.job_report(job_id, recs)
        assert {(r["JobState"], r["ExitCode"]) for r in recs} == {("COMPLETED", "0:0")}, report
        world, nodes = (4, 2) if script == TORCHRUN_ONE_FILE else expected(script)
        for log in (Path(r["StdOut"]) for r in recs):
            if kind == "2d":  # train_tp.py, --tp-size from the node's GPUs: one tensor-parallel group per node
                (r,) = results_in_log(log)
                one = r["dtensor"]["inputs as one DTensor"]
                assert (r["ranks"], r["tp"], r["dp"]) == (world, world // nodes, nodes) and len(r["hosts"]) == nodes, r
                assert r["tp_groups_within_a_host"] and r["train_loss_gap"] <= 1e-5, r
                assert one["backward_bytes"]["all_reduce"] == r["theory"]["backward_bytes"], r
            elif kind == "course":
                results = results_in_log(log)
                assert len(results) == 1, f"{script}: one RESULT line, from rank 0 only\n{report}"
                for r in results:
                    assert r["world_size"] == world and len(r["hosts"]) == nodes, (script, r)
                    assert r["train_loss"][-1] < r["train_loss"][0] and r["ranks_agree"], (script, r)
            else:
                results = plain_results(log)
                assert len(results) == 1, f"{script}: the plain script ran once\n{report}"
                for r in results:
                    assert (r["world_size"], r["per_node"]) == (world, world // nodes), (script, r)
                    assert r["losses"][-1] < r["losses"][0] and r["identical"], (script, r)


@needs_cluster
def test_fabric_runs_under_the_srun_pattern_unchanged(cluster):
    """Fabric reads its ranks from Slurm (srun, one task per GPU) like Lightning."""
    script = REPO_ROOT / "slurm" / "generic" / "multi_node_srun.sbatch"
    job = slurm.sbatch(script, env={"TRAIN_SCRIPT": str(REPO_ROOT / "scripts" / "train_fabric.py"),
                                    "TRAIN_ARGS": TINY, **ONE_THREAD})
    record = slurm.wait([job], timeout_s=300)[job][0]
    report = cluster.job_report(job, [record])
    assert (record["JobState"], record["ExitCode"]) == ("COMPLETED", "0:0"), report
    (result,) = results_in_log(record["StdOut"])
    assert result["world_size"] == 4 and result["hosts"] == {"cnode1": 2, "cnode2": 2}, result
    assert result["ranks_agree"] and result["train_loss"][-1] < result["train_loss"][0], result


def _processes_naming(text: str) -> list[str]:
    """Command lines of the processes on this machine (the test nodes share its PID space) that name ``text``."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # ended while we looked
        if text in cmdline:
            found.append(f"{pid}: {cmdline[:200]}")
    return found


def _no_ray_left(job: int) -> None:
    """Nothing of the job's Ray outlives it. The job's batch script returns only once its nodes' Ray has ended
    (slurm/lib/ray_node.sh); the wait here covers a process the kernel has not yet reaped, not a leak."""
    left: list[str] = []

    def none_left() -> bool:
        left[:] = _processes_naming(f"/tmp/ray-{job}-")
        return not left

    wait_until(none_left, 10, lambda: AssertionError("Ray processes of the job outlived it by 10 s:\n" + "\n".join(left)),
               interval_s=0.2)
    for node in ("cnode1", "cnode2"):
        shutil.rmtree(f"/tmp/ray-{job}-{node}", ignore_errors=True)


@needs_cluster
def test_jobs_on_the_test_cluster_run_a_thread_per_process_unless_told(cluster, tmp_path):
    """Its "nodes" share this machine's two cores: slurm.sbatch gives every job OMP_NUM_THREADS=1 there
    (a sweep of 4 one-process trials took 24 s with torch's default threads, 12 s with one each)."""
    script = tmp_path / "threads.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/%j.out\necho threads=$OMP_NUM_THREADS\n")
    default, told = slurm.sbatch(script), slurm.sbatch(script, env={"OMP_NUM_THREADS": "3"})
    records = slurm.wait([default, told], timeout_s=120)
    assert all(recs[0]["JobState"] == "COMPLETED" for recs in records.values()), records
    assert (tmp_path / f"{default}.out").read_text().split() == ["threads=1"]
    assert (tmp_path / f"{told}.out").read_text().split() == ["threads=3"]


@needs_cluster
def test_two_jobs_on_the_same_first_node_at_once_use_different_ports_and_a_port_taken_is_not_used(cluster):
    """Each job's rendezvous port is free on its first node and below the ports the kernel hands to outgoing
    connections (nothing but another listener can take it before rank 0 listens); the second job asks for a port
    another process of cnode1 holds (COURSE_MASTER_PORT) and starts anyway, on another, saying so in its log."""
    script = REPO_ROOT / "slurm" / "generic" / "multi_node_srun.sbatch"
    holder = subprocess.Popen(["ip", "netns", "exec", "cnode1", sys.executable, "-c", HOLD_A_PORT],
                              stdout=subprocess.PIPE, text=True)
    try:
        held = int(holder.stdout.readline())
        # whoami.py joins the group (rank 0 serves the rendezvous on the job's port) and prints who it is: what
        # a clash needs, without the training
        env = {"TRAIN_SCRIPT": str(REPO_ROOT / "scripts" / "whoami.py"), "TRAIN_ARGS": "", **ONE_THREAD}
        jobs = [slurm.sbatch(script, "--nodelist=cnode1,cnode2", env={**env, **extra})
                for extra in ({}, {"COURSE_MASTER_PORT": str(held)})]
        records = slurm.wait(jobs, timeout_s=600)
    finally:
        holder.kill()
    ports, windows = [], []
    for job in jobs:
        rec = records[job][0]
        report = cluster.job_report(job, records[job])
        assert (rec["JobState"], rec["ExitCode"]) == ("COMPLETED", "0:0"), report
        log = Path(rec["StdOut"]).read_text()
        line = next(x for x in log.splitlines() if "; rendezvous " in x)
        host, port = line.rsplit("rendezvous ", 1)[1].split(":")
        assert host == "cnode1" and int(port) < int(Path(RANGE_FILE).read_text().split()[0]), report
        ports.append(int(port))
        windows.append((rec["StartTime"], rec["EndTime"]))
    assert windows[0][0] <= windows[1][1] and windows[1][0] <= windows[0][1], f"the jobs did not overlap: {windows}"
    assert ports[0] != ports[1], f"both jobs listened on port {ports[0]} of cnode1"
    assert ports[1] != held and f"COURSE_MASTER_PORT={held} is in use on cnode1: using another" in log, log


RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
# A listener on a port below the ephemeral range, as another job's rank 0 would hold it; prints the port
HOLD_A_PORT = """import random, socket, time
s = socket.socket()
while True:
    try:
        s.bind(("", random.randrange(21000, 31000)))
        break
    except OSError:
        pass
s.listen()
print(s.getsockname()[1], flush=True)
time.sleep(900)
"""


def test_a_rendezvous_port_is_drawn_below_the_ephemeral_range_and_a_port_taken_is_replaced(capsys):
    """slurm/lib/rendezvous_port.py, as course_rendezvous and ray_node.sh call it: distinct free ports below the
    range the kernel gives outgoing connections; the wanted one where it is free, another and a note where not."""
    spec = importlib.util.spec_from_file_location("rendezvous_port", REPO_ROOT / "slurm" / "lib" / "rendezvous_port.py")
    rp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rp)
    taken = {20000 + i for i in range(0, 12000, 2)}  # every other port held
    ports, note = rp.choose(5, wanted=24000, top=32000, free=lambda p: p not in taken)
    assert len(set(ports)) == 5 and all(rp.LOWEST <= p < 32000 and p not in taken for p in ports), ports
    assert note and "COURSE_MASTER_PORT=24000 is in use" in note, note
    assert rp.choose(1, wanted=24001, top=32000, free=lambda p: p not in taken) == ([24001], None)
    with socket.socket() as s:  # the real thing: a port held here
        s.bind(("", 0))
        s.listen()
        held = s.getsockname()[1]
        out = subprocess.run([sys.executable, str(REPO_ROOT / "slurm" / "lib" / "rendezvous_port.py"), "--wanted",
                              str(held)], capture_output=True, text=True, timeout=60)
    (port,) = map(int, out.stdout.split())
    assert port != held and port < rp.ephemeral_start() and out.stderr.count("\n") == 1, out


def test_rank_0_that_cannot_listen_on_its_port_says_so_in_one_line(monkeypatch):
    """torch's own error for a port another process holds (what Lightning's and Fabric's process groups raise with a
    traceback) becomes one line naming the port and the node; the course's rendezvous says the same."""
    import torch.distributed as dist

    from course_utils.process_group import listen_failure
    from course_utils.process_group.rendezvous import listen_refused

    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        held = s.getsockname()[1]
        with pytest.raises(dist.DistNetworkError) as caught:
            dist.TCPStore("127.0.0.1", held, 2, True, wait_for_workers=False)
    monkeypatch.setenv("MASTER_PORT", str(held))
    line = listen_failure(caught.value)
    host = socket.gethostname().split(".")[0]
    assert line == listen_refused(held) and f"rank 0 on {host} could not listen on port {held}" in line, line
    assert "\n" not in line and listen_failure(RuntimeError("failed to listen")) is None


@needs_cluster
def test_notebook_cells_submit_to_a_real_cluster_only_when_asked_and_cancel_what_an_interrupt_leaves(cluster, tmp_path):
    """The gate the notebooks' Slurm cells go through: the test cluster always, any other cluster only with
    SUBMIT = True; and a cell stopped mid-wait leaves no job in the queue."""
    assert slurm.submission_refused(False) is None, "the course's own test cluster needs no opt-in"
    refusal = slurm.submission_refused(False, cluster="ft3")
    assert refusal and "SUBMIT = True" in refusal and "'ft3'" in refusal
    assert slurm.submission_refused(True, cluster="ft3") is None
    script = tmp_path / "long.sbatch"
    script.write_text("#!/bin/bash\n#SBATCH --output=/dev/null\nsleep 300\n")
    with pytest.raises(KeyboardInterrupt):
        with slurm.Submissions(time_limit="00:05:00") as jobs:
            job = jobs.sbatch(script)
            wait_until(lambda: _state(job) == "RUNNING", 60, "the job never started")
            assert slurm.job_records(job)[0]["TimeLimit"] == "00:05:00", "the cell's short limit, not the script's"
            raise KeyboardInterrupt  # Jupyter's stop button, while the cell waits
    wait_until(lambda: _state(job) == "CANCELLED", 30, "the interrupted cell's job lives on")


def test_a_cell_without_slurm_shows_ft3_s_command_lines_and_says_why(monkeypatch):
    monkeypatch.setattr(slurm, "available", lambda: "sbatch is not on the PATH: this machine is not a Slurm login node")
    plan = slurm.cell_plan(True)
    assert not plan.submits and plan.site == "ft3" and plan.why_not.startswith("no Slurm here (sbatch is not")
    assert plan.script("requeue") == REPO_ROOT / "slurm" / "ft3" / "requeue.sbatch"


@needs_cluster
def test_a_cell_submits_the_site_s_scripts_where_it_may(cluster):
    here = slurm.cell_plan(False)
    assert here == slurm.CellPlan("generic", None), "the test cluster: generic's scripts, no opt-in"
    assert "practice cluster, which needs no SUBMIT = True" in here.line, "and the cell's first line says why"
    frontera = slurm.cell_plan(False, {"TACC_SYSTEM": "frontera"}, cluster="frontera")
    assert frontera.site == "frontera" and not frontera.submits and "SUBMIT = True" in frontera.why_not
    assert frontera.line.startswith("not submitting: Slurm cluster 'frontera' found"), frontera.line
    assert slurm.cell_plan(True, {"TACC_SYSTEM": "frontera"}, cluster="frontera").submits


def test_the_site_whose_scripts_a_cell_uses():
    assert slurm.site_here({"TACC_SYSTEM": "frontera"}, cluster="frontera") == "frontera"
    assert slurm.site_here({}, cluster="ft3") == "ft3"
    assert slurm.site_here({}, cluster=slurm.TEST_CLUSTER) == "generic"
    assert slurm.site_here({"COURSE_SITE": "ft3"}, cluster="other") == "ft3"
    with pytest.raises(slurm.SlurmError, match="COURSE_SITE must name a folder"):
        slurm.script_for("one_node", "nowhere")


def run_sbatch_by_hand(script: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(REPO_ROOT / "slurm" / script)], capture_output=True, text=True,
                          env={"PATH": "/usr/bin:/bin", **env})


def test_script_outside_slurm_says_so():
    out = run_sbatch_by_hand("ft3/one_node.sbatch")
    assert out.returncode != 0 and "submit it with sbatch" in out.stderr


def test_submitted_from_the_wrong_folder_says_where_to_submit_from(tmp_path):
    out = run_sbatch_by_hand("generic/one_node.sbatch", SLURM_JOB_ID="1", SLURM_SUBMIT_DIR=str(tmp_path))
    assert out.returncode == 2
    assert "is not the course repository: submit from its root, or set COURSE_ROOT" in out.stderr


def test_a_missing_train_script_is_named(tmp_path):
    out = run_sbatch_by_hand("generic/one_node.sbatch", SLURM_JOB_ID="1", SLURM_SUBMIT_DIR=str(REPO_ROOT),
                             TRAIN_SCRIPT=str(tmp_path / "nope.py"))
    assert out.returncode == 2 and f"TRAIN_SCRIPT={tmp_path / 'nope.py'} does not exist" in out.stderr


def test_scripts_pass_shellcheck():
    import shutil

    if shutil.which("shellcheck") is None:
        pytest.skip("shellcheck is not installed (apt-get install shellcheck; the suite installs it as root)")
    libs = sorted((REPO_ROOT / "slurm" / "lib").glob("*.sh")) + sorted((REPO_ROOT / "slurm").glob("ddp_*.sbatch"))
    out = subprocess.run(["shellcheck", "-x", "-s", "bash", *map(str, SCRIPTS + libs)],
                         capture_output=True, text=True, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stdout


def test_the_command_a_cell_prints_without_submit_is_the_one_it_would_submit(monkeypatch):
    """Notebooks 04-06 print slurm.command_line(...) where the learner has not set SUBMIT = True: pasted, it must queue
    the cell's short job (its --time), not the script's own request (FT3's multi_node_srun: 2 nodes for 30 minutes)."""
    import shlex

    submitted = []
    monkeypatch.setattr(slurm, "sbatch", lambda script, *options, env=None: submitted.append(list(options)) or 1)
    script = REPO_ROOT / "slurm" / "ft3" / "multi_node_srun.sbatch"
    env = {"TRAIN_ARGS": "--model cnn --epochs 2"}
    with slurm.Submissions() as jobs:
        jobs.sbatch(script, env=env)
    (options,) = submitted
    expected = ["TRAIN_ARGS=--model cnn --epochs 2", "sbatch", *options, "slurm/ft3/multi_node_srun.sbatch"]
    assert shlex.split(slurm.command_line(script, env=env)) == expected
    assert shlex.split(jobs.command_line(script, env=env)) == expected
    assert f"--time={slurm.TIME_LIMIT}" in options and slurm.sbatch_options(script)["--time"] != slurm.TIME_LIMIT


def _course_job(tmp_path: Path, job_id: str, **env: str) -> subprocess.CompletedProcess:
    """What the Ray pattern's batch shell computes, without Slurm: RUN_DIR, then tune.py's argv as the script passes it."""
    shell = 'source slurm/lib/course_job.sh && printf "%s\\n" "$RUN_DIR" "${TRAIN_ARGV[@]}"'
    return subprocess.run(["bash", "-c", shell], capture_output=True, text=True, cwd=REPO_ROOT, env={
        "PATH": "/usr/bin:/bin", "SLURM_JOB_ID": job_id, "SLURM_JOB_NAME": "ft3-multi-node-ray",
        "SLURM_JOB_NUM_NODES": "2", "SLURM_SUBMIT_DIR": str(REPO_ROOT), "COURSE_RUNS": str(tmp_path),
        "TRAIN_SCRIPT": "scripts/tune.py", "TRAIN_ARGS": "--num-samples 4", **env})


def test_a_resubmitted_ray_search_finds_its_folder_and_keeps_a_storage_of_your_own(tmp_path, monkeypatch):
    """A resubmission is a new job id: COURSE_RUN_NAME names the folder, so the new job's tune.py resumes the search
    saved there (its --storage defaults to the job's RUN_DIR/tune, its --nodes to the job's nodes); a --storage in
    TRAIN_ARGS is the one tune.py gets (the batch script adds no flag of its own)."""
    spec = importlib.util.spec_from_file_location("tune_script", REPO_ROOT / "scripts" / "tune.py")
    tune_script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tune_script)

    def job(job_id: str, **env: str) -> tuple[str, object]:
        out = _course_job(tmp_path, job_id, **env)
        assert out.returncode == 0, out.stderr
        run_dir, *argv = out.stdout.splitlines()
        for name, value in {"RUN_DIR": run_dir, "SLURM_JOB_ID": job_id, "SLURM_JOB_NUM_NODES": "2"}.items():
            monkeypatch.setenv(name, value)  # what tune.py sees in that job
        return run_dir, tune_script.build_parser().parse_args(argv)

    first, second = job("101"), job("202")
    assert first[0] != second[0], "without a name, each job has its own folder"
    first, second = job("101", COURSE_RUN_NAME="my-search"), job("202", COURSE_RUN_NAME="my-search")
    assert first[0] == second[0] == str(tmp_path / "my-search")
    assert first[1].storage == second[1].storage == str(tmp_path / "my-search" / "tune")
    assert (first[1].num_samples, first[1].nodes) == (4, 2)
    _, own = job("303", TRAIN_ARGS=f"--num-samples 4 --storage {tmp_path / 'mine'}")
    assert own.storage == str(tmp_path / "mine") and own.nodes == 2, "the user's --storage, the job's nodes"
    refused = _course_job(tmp_path, "404", COURSE_RUN_NAME="a/b")
    assert refused.returncode == 2 and "is a folder name under COURSE_RUNS" in refused.stderr


FAKE_RAY = """#!/bin/bash
# `ray start` as Ray 2.60 does it when the dashboard agent misses the raylet's 15 s: fails FAKE_RAY_FAILS times on a node
count="$FAKE_RAY_DIR/calls"; n=$(( $(cat "$count" 2>/dev/null || echo 0) + 1 )); echo "$n" > "$count"
while [[ "$1" != --temp-dir ]]; do shift; done
if (( n <= FAKE_RAY_FAILS )); then
    mkdir -p "$2/session_latest/logs"
    echo "[2026-11-25 08:08:20,580 C 4884 4884] (raylet) node_manager.cc:3588:  An unexpected system state has occurred." \\
         "Check failed: statusor.has_value() Timed out waiting for file $2/session_x/dashboard_agent_listen_port_0a1b" \\
         > "$2/session_latest/logs/raylet.out"
    echo "Exception: The current node timed out during startup."
    exit 1
fi
echo "Ray runtime started."
"""
# the warm-up import of Ray's agents (`python -`) is skipped: the fake ray needs no agent
FAKE_PYTHON = """#!/bin/bash
if [[ "$1" == - ]]; then cat > /dev/null; exit 0; fi
exec {python} "$@"
"""


def test_ray_node_keeps_trying_with_back_off_until_its_bound_then_says_what_failed(tmp_path):
    """slurm/lib/ray_node.sh against a fake `ray start` that fails as Ray 2.60's does when the dashboard agent is late
    (a busy node): the head tries again, waiting longer each time, and joins at its 4th try (3 tries used to be all);
    a node that never starts ends within RAY_START_TIMEOUT with one line naming the node, the raylet's fatal line
    and its log. (A real agent slowed on purpose costs 16 s a failed try: too much for the suite.)"""
    import sys

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text(FAKE_RAY)
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    for fake in bin_dir.iterdir():
        fake.chmod(0o755)
    runs = {}
    for name, fails, bound in (("joins", 3, 60), ("never", 1000, 3)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "joined").mkdir()
        env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "SLURM_JOB_ID": f"t{os.getpid()}{name}", "SLURM_CPUS_PER_TASK": "1",
               "RAY_JOINED_DIR": str(tmp_path / name / "joined"), "FAKE_RAY_DIR": str(tmp_path / name),
               "FAKE_RAY_FAILS": str(fails), "RAY_START_TIMEOUT": str(bound), "RAY_START_BACKOFF_S": "1"}
        runs[name] = subprocess.Popen(["bash", str(REPO_ROOT / "slurm" / "lib" / "ray_node.sh"), "head", "6379"],
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    start = time.monotonic()
    out = {name: proc.communicate(timeout=60) for name, proc in runs.items()}
    seconds = time.monotonic() - start
    node = os.uname().nodename.split(".")[0]
    try:
        stdout, stderr = out["joins"]
        assert (tmp_path / "joins" / "joined" / node).exists(), stdout + stderr
        assert "try 4" in stdout and [line.rsplit("next try in ", 1)[1] for line in stdout.splitlines()
                                      if "next try in" in line] == ["1 s", "2 s", "4 s"], stdout
        assert "failed (Timed out waiting for file" in stdout, stdout
        stdout, stderr = out["never"]
        assert runs["never"].returncode == 1 and not any((tmp_path / "never" / "joined").iterdir())
        (error,) = stderr.strip().splitlines()
        assert error.startswith(f"error: Ray's head on {node} did not start in ") and "RAY_START_TIMEOUT=3" in error
        assert "Timed out waiting for file" in error and f"/tmp/ray-t{os.getpid()}never-{node}/session_latest" in error
        assert seconds < 20, f"the bound is 3 s, the back-off 1 s doubling: {seconds:.0f} s"
    finally:
        for name in runs:
            shutil.rmtree(f"/tmp/ray-t{os.getpid()}{name}-{node}", ignore_errors=True)


def test_fsdp2_through_the_deepspeed_pattern_checkpoints_to_the_job_s_folder(tmp_path):
    """multi_node_deepspeed's comment says FSDP2 (TRAIN_SCRIPT=scripts/train_fsdp.py) runs there too, with its
    checkpoints in the job's folder, where a resubmission with COURSE_RUN_NAME finds them: the batch script adds
    no flag, the script finds RUN_DIR (one process here, as the job's environment would start it)."""
    tiny = "--model mlp --epochs 1 --n-train 64 --n-val 32 --batch-size 32 --workers 0 --device cpu"
    out = _course_job(tmp_path, "505", TRAIN_SCRIPT="scripts/train_fsdp.py", TRAIN_ARGS=tiny,
                      COURSE_RUN_NAME="fsdp-run")
    assert out.returncode == 0, out.stderr
    run_dir, *argv = out.stdout.splitlines()
    assert run_dir == str(tmp_path / "fsdp-run") and "--ckpt-dir" not in argv, argv
    run_script("train_fsdp.py", argv, env={"RUN_DIR": run_dir, "SLURM_JOB_ID": "505", **ONE_THREAD}, echo=False,
               timeout_s=300)
    assert (tmp_path / "fsdp-run" / "ckpt" / "latest").is_file(), "the sharded checkpoint went to RUN_DIR/ckpt"


# --------------------------------------------------------------------------- #
# The practice cluster (make cluster): the suite's cluster, as a learner meets it
# --------------------------------------------------------------------------- #
PRACTICE = REPO_ROOT / "slurm" / "practice_cluster.py"


@needs_cluster
def test_a_second_make_cluster_keeps_the_running_cluster_and_its_jobs(cluster, tmp_path):
    pid = (cluster.work / "slurmctld.pid").read_text().strip()
    script = tmp_path / "sleep.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/%j.out\nsleep 60\n")
    job = slurm.sbatch(script)
    try:
        out = subprocess.run(["make", "-s", "cluster"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and "already up" in out.stdout and f"SLURM_CONF={cluster.conf}" in out.stdout, \
            out.stdout + out.stderr
        assert (cluster.work / "slurmctld.pid").read_text().strip() == pid and cluster.running(), "the same controller"
        assert _state(job) in ("PENDING", "RUNNING"), "and the job in it goes on"
    finally:
        subprocess.run(["scancel", str(job)], check=False)


@needs_cluster
def test_a_second_checkout_s_cluster_is_refused_in_one_line_and_the_running_one_goes_on(cluster, tmp_path):
    """Another checkout on the same machine (a second suite, a colleague's `make cluster`) would take the same node
    names, addresses and bridge: its start is refused in one line that names the running cluster and its checkout,
    before anything of the running one is touched."""
    other = tmp_path / "other-checkout"
    (other / "slurm").mkdir(parents=True)
    shutil.copy(REPO_ROOT / "slurm" / "practice_cluster.py", other / "slurm")
    script = tmp_path / "sleep.sbatch"
    script.write_text(f"#!/bin/bash\n#SBATCH --output={tmp_path}/%j.out\nsleep 60\n")
    job = slurm.sbatch(script)
    try:
        out = subprocess.run([sys.executable, str(other / "slurm" / "practice_cluster.py"), "up"], capture_output=True,
                             text=True, timeout=120, env={**os.environ, "COURSE_SLURM_DIR": str(tmp_path / "second")})
        said = out.stderr.strip()
        assert out.returncode != 0 and said.startswith("error: a practice cluster is already running") \
            and "\n" not in said, out.stdout + out.stderr
        assert str(cluster.work) in said and f"started from {REPO_ROOT}" in said, said
        assert not (tmp_path / "second" / "slurm.conf").exists(), "nothing of a second cluster was made"
        assert cluster.running() and _state(job) in ("PENDING", "RUNNING"), "the first goes on"
    finally:
        subprocess.run(["scancel", str(job)], check=False)


@needs_cluster
@pytest.mark.skipif(shutil.which("runuser") is None, reason="runuser (util-linux) starts a command as another user")
def test_a_learner_s_account_submits_to_the_practice_cluster_and_the_job_runs_as_the_learner(cluster):
    """The cluster runs as root; a learner's jobs run as the learner (auth/none trusts the uid that submits)."""
    out_dir = Path(tempfile.mkdtemp(prefix="course-practice-"))
    try:
        out_dir.chmod(0o777)
        submitted = subprocess.run(["runuser", "-u", "nobody", "--", "env", f"SLURM_CONF={cluster.conf}", "sbatch",
                                    "--parsable", f"--output={out_dir}/%j.out", "--wrap", "id -un; hostname"],
                                   capture_output=True, text=True, timeout=60)
        assert submitted.returncode == 0, submitted.stderr
        job = int(submitted.stdout.strip().split(";")[0])
        record = slurm.wait([job], timeout_s=120)[job][0]
        assert record["JobState"] == "COMPLETED", cluster.job_report(job, [record])
        who, host = (out_dir / f"{job}.out").read_text().split()[:2]
        assert who == "nobody" and host in ("cnode1", "cnode2"), (who, host)
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")  # another user may not reach the project's .venv


@pytest.mark.skipif(sys.platform != "linux" or shutil.which("runuser") is None or os.geteuid() != 0
                    or SYSTEM_PYTHON is None, reason="runs the command as another user (runuser, as root, on Linux)")
def test_without_root_or_sudo_make_cluster_says_in_one_line_what_it_needs():
    out = subprocess.run(["runuser", "-u", "nobody", "--", "env", "PATH=/nonexistent", "PYTHONDONTWRITEBYTECODE=1",
                          SYSTEM_PYTHON, str(PRACTICE), "up"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    (line,) = out.stderr.strip().splitlines()
    assert "needs root" in line and "sudo" in line and "print the sbatch lines" in line, line


def test_the_practice_cluster_is_the_one_the_notebooks_know_by_name():
    assert slurm_cluster_module.CLUSTER_NAME == slurm.TEST_CLUSTER


def test_a_port_in_use_gives_the_controller_another():
    """A machine with a Slurm of its own holds slurmctld's port 6817: the practice cluster takes another."""
    assert slurm_cluster_module.free_port(6817, free=lambda port: True) == 6817
    with socket.socket() as held:
        held.bind(("0.0.0.0", 0))
        held.listen()
        taken = held.getsockname()[1]
        other = slurm_cluster_module.free_port(taken)
    assert other != taken and 1024 <= other < 65536



def _detected(cluster, tmp_path: Path, name: str) -> tuple[str, Path]:
    """python slurm/generate.py --detect NAME against ``cluster`` (in a copy of slurm/): the site file's text
    and the folder of its scripts, each of them accepted by the cluster (sbatch --test-only)."""
    copy = tmp_path / "slurm"
    shutil.copytree(REPO_ROOT / "slurm", copy, ignore=shutil.ignore_patterns("ft3", "frontera", "generic"))
    out = subprocess.run([sys.executable, str(copy / "generate.py"), "--detect", name], capture_output=True,
                         text=True, timeout=120, env={**os.environ, **cluster.env})
    assert out.returncode == 0, out.stdout + out.stderr
    scripts = sorted((copy / name).glob("*.sbatch"))
    assert [s.stem for s in scripts] == generate.patterns()
    for script in scripts:
        test_only = subprocess.run(["sbatch", "--test-only", str(script)], capture_output=True, text=True,
                                   cwd=REPO_ROOT, env={**os.environ, "TRAIN_ARGS": TINY})
        assert test_only.returncode == 0 and "to start at" in test_only.stderr, (script.name, test_only.stderr)
    return (copy / "sites" / f"{name}.toml").read_text(), copy / name


@needs_cluster
def test_a_site_file_detected_on_the_cluster_asks_for_what_it_has(cluster, tmp_path):
    """python slurm/generate.py --detect NAME on a login node: the site file from the cluster's own answers,
    then its scripts, each accepted by the cluster. (Other layouts, from scontrol's lines:
    tests/test_detect_site.py; another centre's layout live, every pattern run: the tests at the end.)"""
    site, _ = _detected(cluster, tmp_path, "practice")
    assert "--partition=debug" in site and 'gres = "gpu:a100"' in site and "cores_per_node = 64" in site, site
    assert "gpus_per_node = 2" in site, site


def _reboot(cluster) -> None:
    """What a reboot does to a running practice cluster: its processes and its network devices go (the daemons
    killed without warning); the files it wrote stay."""
    m = slurm_cluster_module
    subprocess.run(["pkill", "-KILL", "-f", "--", str(cluster.conf)], check=False)
    wait_until(lambda: subprocess.run(["pgrep", "-f", "--", str(cluster.conf)], capture_output=True).returncode == 1,
               30, "the cluster's daemons outlived SIGKILL", interval_s=0.2)
    for name, _ in m.NODES:
        subprocess.run(["ip", "netns", "del", name], check=False)
    subprocess.run(["ip", "link", "del", m.BRIDGE], check=False)


@needs_cluster
def test_after_a_reboot_make_cluster_down_cleans_up_and_make_cluster_starts_anew(cluster):
    """The laptop reboots with the course's cluster up: its daemons and its network (namespaces, bridge: kernel
    state) are gone, its files are not (the config make lab reads, the /etc/hosts lines). The learner's `make
    cluster-down` (a new process, which started nothing) removes what is left, and `make cluster` starts again."""
    m = slurm_cluster_module
    try:
        _reboot(cluster)
        assert cluster.conf.exists() and m.HOSTS_MARK in Path("/etc/hosts").read_text(), "what a reboot leaves"
        assert not m.SlurmTestCluster(cluster.work).running(), "make cluster starts anew, not 'already up'"
        m.SlurmTestCluster(cluster.work).down()
        assert not cluster.conf.exists() and m.HOSTS_MARK not in Path("/etc/hosts").read_text(), "down cleaned up"
    finally:
        cluster.up()
    assert cluster.running()


# --------------------------------------------------------------------------- #
# Another centre: the same two nodes started with another configuration (queues standard and gpu-long, four
# v100s and 32 CPUs a node, jobs share nodes), its site file detected, every pattern run unchanged. The tests
# that use it come last in this file: the course's cluster stops once and starts again once.
# --------------------------------------------------------------------------- #
@pytest.fixture(scope="module")
def other_centre(cluster, tmp_path_factory):
    """(the other centre's cluster, its detected site file's text, the folder of its scripts)"""
    other = slurm_cluster_module.SlurmTestCluster()
    try:
        other.up(layout=slurm_cluster_module.OTHER)
        site, scripts = _detected(other, tmp_path_factory.mktemp("othercentre"), "othercentre")
        yield other, site, scripts
    finally:
        other.down()
        cluster.up()  # the notebooks submit to the course's cluster


@needs_cluster
def test_a_site_file_detected_on_another_centre_s_layout_asks_for_what_it_has(other_centre):
    _, site, _ = other_centre
    assert "--partition=standard" in site and 'gres = "gpu:v100"' in site, site
    assert "gpus_per_node = 4" in site and "cores_per_node = 32" in site and "whole_nodes = false" in site, site


PROBE = str(REPO_ROOT / "scripts" / "launch_probe.py")


def _probes(log: Path) -> list[dict]:
    return [json.loads(line[6:]) for line in log.read_text().splitlines() if line.startswith("PROBE ")]


def test_the_launch_probe_outside_a_launcher_is_rank_0_of_1_and_tells_all_gpus_from_none():
    """A plain `python scripts/launch_probe.py`: world 1, as the course counts it; no CUDA_VISIBLE_DEVICES means
    every GPU of the node, an empty one none."""
    base = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES")}
    seen = {}
    for case, extra in (("unset", {}), ("empty", {"CUDA_VISIBLE_DEVICES": ""})):
        out = subprocess.run([sys.executable, PROBE], capture_output=True, text=True, timeout=60, env={**base, **extra})
        line, probe = out.stdout.splitlines()
        seen[case] = (line, json.loads(probe[len("PROBE "):]))
    assert seen["unset"][1]["gpus"] is None and "every GPU of the node" in seen["unset"][0], seen
    assert seen["empty"][1]["gpus"] == [] and "GPUs none" in seen["empty"][0], seen
    assert all((p["rank"], p["world_size"]) == (0, 1) for _, p in seen.values()), seen


@needs_cluster
def test_every_pattern_of_a_detected_site_runs_unchanged_a_rank_per_gpu(other_centre):
    """Each generated script of the other centre, with scripts/launch_probe.py as its TRAIN_SCRIPT (what a
    researcher runs first at a new centre): every process reports its rank and the GPUs it sees, and the course's
    device policy (devices.place_ranks, as the course's scripts call it) gives each rank of a job its own GPU, the
    one LOCAL_RANK names (a plain torchrun script's choice), and each writes a file into the RUN_DIR the pattern
    hands it (each trial of the array its own). That ranks so started meet and train: notebook 04 (the plain DDP
    script through the same srun template). (The Ray pattern: the next test.)"""
    other, _, scripts = other_centre
    patterns = [p for p in generate.patterns() if p != "multi_node_ray"]
    jobs = {slurm.sbatch(scripts / f"{p}.sbatch", env={"TRAIN_SCRIPT": PROBE, "TRAIN_ARGS": "--probe"}): p
            for p in patterns}
    records = slurm.wait(list(jobs), timeout_s=600)
    for job, pattern in jobs.items():
        report = other.job_report(job, records[job])
        assert {(r["JobState"], r["ExitCode"]) for r in records[job]} == {("COMPLETED", "0:0")}, report
        seen = [p for r in records[job] for p in _probes(Path(r["StdOut"]))]
        # every process saved into the RUN_DIR its pattern handed it, without creating it (a researcher's script)
        assert seen and all(p["wrote"] and Path(p["wrote"]).is_file() for p in seen), (pattern, report)
        if pattern == "sweep_array":  # four array tasks, a trial each, each on its own one GPU
            assert sorted(p["args"][-1] for p in seen) == ["0.01", "0.02", "0.05", "0.1"], report
            assert all(p["world_size"] == 1 and len(p["gpus"]) == 1 for p in seen), report
            continue
        nodes = 2 if pattern.startswith("multi_node") else 1
        seen.sort(key=lambda p: p["rank"])
        assert [p["rank"] for p in seen] == list(range(4 * nodes)), (pattern, report)
        assert {(p["world_size"], p["local_world_size"]) for p in seen} == {(4 * nodes, 4)}, (pattern, seen)
        assert len({p["host"] for p in seen}) == nodes and len({p["rendezvous"] for p in seen}) == 1, (pattern, seen)
        placed = place_ranks([RankView(p["host"], tuple(p["gpus"])) for p in seen], "cuda")
        assert [d.device for d in placed] == [f"cuda:{p['local_rank']}" for p in seen], (pattern, placed, seen)


@needs_cluster
def test_the_ray_pattern_starts_on_cold_nodes_waits_for_every_node_and_requeues_a_search(other_centre, tmp_path):
    """The other centre's Ray pattern (32 cores a node: one trial of 32 CPUs per node) starts where the first import
    of Ray's agent on a node takes 17 s (tests/slow_imports: a cold Lustre; Ray 2.60's raylet gives the agent
    15 s). The course's search is told to wait for one node only (--nodes 1), so the nodes it finds at its
    first line are those the job script waited for: every node, as any Ray script of a researcher's would see
    them. Its trials spread over both nodes and save into the RUN_DIR the job made; Slurm's warning stops the
    search, the job requeues, and the next start finishes the search from its folder. No Ray process is left.
    (FT3's and Frontera's scripts are the same template with other #SBATCH lines: sbatch --test-only above; a
    request no node holds: tests/test_tune.py.)"""
    cluster, _, scripts = other_centre
    search = ("--model cnn --epochs 3 --n-train 256 --n-val 64 --batch-size 32 --workers 0 --num-samples 2 "
              "--cpus-per-trial 32 --held-out 200 --scheduler fifo --nodes 1")
    env = {"COURSE_RUNS": str(tmp_path), "PYTHONPATH": str(REPO_ROOT / "tests" / "slow_imports"),
           "TRAIN_ARGS": search, **ONE_THREAD}
    job = slurm.sbatch(scripts / "multi_node_ray.sbatch", env=env)
    search_dir = tmp_path / f"othercentre-multi-node-ray-{job}" / "tune" / "search"

    def first_trial_reported() -> bool:
        assert (slurm.job_records(job) or [{}])[0].get("JobState") in ("PENDING", "CONFIGURING", "RUNNING")
        return any(search_dir.glob("*/checkpoint_*"))

    # signalled at a trial's first checkpoint, with 2 of its 3 epochs to go: the search cannot end before the signal
    wait_until(first_trial_reported, 600, lambda: AssertionError(cluster.job_report(job, slurm.job_records(job))),
               interval_s=0.5)
    slurm.signal_batch(job, "USR1")  # what --signal=B:USR1@120 does before the time limit
    slurm.wait_requeued(job)
    slurm.release(job)
    records = slurm.wait([job], timeout_s=900)

    record = records[job][0]
    report = cluster.job_report(job, records[job])
    assert (record["JobState"], record["ExitCode"], record["Restarts"]) == ("COMPLETED", "0:0", "1"), report
    stopped, final = results_in_log(record["StdOut"])
    assert len(stopped["nodes"]) == 2 and len(final["nodes"]) == 2, "each start's script found both nodes joined"
    assert stopped["stopped"] and not final["stopped"] and final["trials"] == 2 and final["errored"] == 0, report
    assert all(s == "completed" for s in final["statuses"]) and final["hosts"] == ["cnode1", "cnode2"], final
    # trials of no GPU on nodes of 4: Ray hid the node's GPUs (CUDA_VISIBLE_DEVICES empty), not left them "0,1,2,3"
    assert final["gpus_seen"] == ["none"], final
    assert Path(final["path"]) == search_dir, final["path"]
    _no_ray_left(job)
