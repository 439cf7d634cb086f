"""Submitting and watching Slurm jobs from Python (notebooks 04-06, the tests).

A notebook cell submits only to the course's own test cluster, or where the learner
opted in (``SUBMIT = True`` in the cell): on a cluster's login node ``sbatch`` reaches
the production queue and the learner's allocation. :class:`Submissions` cancels what a
cell submitted when the cell is interrupted or fails.

Waiting polls ``scontrol show job`` rather than ``sbatch --wait``, which backs
off by tens of seconds, and works without Slurm's accounting database (where
``sacct`` has nothing to say).
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from .paths import REPO_ROOT
from .waiting import wait_until

FINAL_STATES = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL",
                "DEADLINE", "PREEMPTED")


class SlurmError(RuntimeError):
    pass


def available() -> str | None:
    """None if ``sbatch`` is here and a controller answers, else why not."""
    if shutil.which("sbatch") is None:
        return "sbatch is not on the PATH: this machine is not a Slurm login node"
    out = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True)
    if out.returncode != 0:
        return f"sinfo failed: {(out.stderr or out.stdout).strip().splitlines()[-1:]}"
    return None


TEST_CLUSTER = "coursetest"  # the ClusterName of slurm/practice_cluster.py (CLUSTER_NAME): the suite's and make cluster's


def cluster_name() -> str:
    """The ClusterName of the Slurm this machine talks to ('' if none answers)."""
    out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True)
    found = re.search(r"^ClusterName\s*=\s*(\S+)", out.stdout, re.MULTILINE)
    return found.group(1) if out.returncode == 0 and found else ""


def submission_refused(opt_in: bool, cluster: str | None = None) -> str | None:
    """None if a notebook cell may submit jobs here; else why not and what to do.

    The course's test cluster always may (it is this machine); a real cluster only with the
    learner's opt-in, since every job there is queued on their allocation."""
    why = available()
    if why is not None:
        return f"no Slurm here ({why})"
    cluster = cluster_name() if cluster is None else cluster
    if opt_in or cluster == TEST_CLUSTER:
        return None
    return (f"Slurm cluster '{cluster}' found, and this cell submits only with your say-so: set "
            "SUBMIT = True in the cell and run it again (its jobs are small, minutes each, and use your allocation)")


def site_here(environ: dict[str, str] | None = None, cluster: str | None = None) -> str:
    """Which ``slurm/<site>/`` scripts fit this cluster: COURSE_SITE if set, Frontera where TACC says
    so, FT3 where the cluster is named ft3; the generic scripts elsewhere (the test cluster too)."""
    environ = os.environ if environ is None else environ
    if environ.get("COURSE_SITE"):
        return environ["COURSE_SITE"]
    if environ.get("TACC_SYSTEM") == "frontera":
        return "frontera"
    return "ft3" if (cluster_name() if cluster is None else cluster).lower() == "ft3" else "generic"


def script_for(pattern: str, site: str | None = None) -> Path:
    """The site's own script for a launch pattern (``slurm/<site>/<pattern>.sbatch``)."""
    script = REPO_ROOT / "slurm" / (site or site_here()) / f"{pattern}.sbatch"
    if not script.is_file():
        raise SlurmError(f"no {script.relative_to(REPO_ROOT)}: COURSE_SITE must name a folder of slurm/")
    return script


@dataclass(frozen=True)
class CellPlan:
    """What a notebook's Slurm cell does here (:func:`cell_plan`): submit ``site``'s scripts, or, with
    ``why_not``, print the command lines it would have submitted (FT3's where no Slurm answers)."""

    site: str
    why_not: str | None
    cluster: str = field(default="", compare=False)  # the Slurm cluster that answers here ('' where none does)

    @property
    def submits(self) -> bool:
        return self.why_not is None

    @property
    def line(self) -> str:
        """What the cell does here, in one line: a cell prints it first."""
        if not self.submits:
            return f"not submitting: {self.why_not}"
        if self.cluster == TEST_CLUSTER:
            return (f"submitting slurm/{self.site}/ scripts to the course's practice cluster, which needs no "
                    "SUBMIT = True (SUBMIT guards a real cluster's queue)")
        return f"submitting slurm/{self.site}/ scripts to the Slurm cluster '{self.cluster}' (SUBMIT = True)"

    def script(self, pattern: str) -> Path:
        return script_for(pattern, self.site)


def cell_plan(submit: bool, environ: dict[str, str] | None = None, cluster: str | None = None) -> CellPlan:
    """The decision every Slurm cell of the notebooks starts with, in one place: it submits on the course's
    test cluster, on a real one only with ``SUBMIT = True`` (:func:`submission_refused`); its scripts are
    this cluster's site's (:func:`site_here`), or FT3's to show where no Slurm answers."""
    if available() is not None:
        return CellPlan("ft3", submission_refused(submit, cluster))
    cluster = cluster_name() if cluster is None else cluster
    return CellPlan(site_here(environ, cluster), submission_refused(submit, cluster), cluster)


TIME_LIMIT = "00:15:00"  # a notebook cell's jobs are minutes long: never the hours a script asks for itself


def command_line(script: str | Path, *options: str, env: dict[str, str] | None = None,
                 time_limit: str | None = TIME_LIMIT) -> str:
    """The shell command that submits ``script`` as a cell's :class:`Submissions` would, its time limit included
    (shown where a cell may not submit: pasted, it must queue the cell's short job, not the script's own request)."""
    path = Path(script)
    shown = path.relative_to(REPO_ROOT) if path.is_relative_to(REPO_ROOT) else path
    assignments = [f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()]
    added = [f"--time={time_limit}"] if time_limit else []
    return " ".join([*assignments, "sbatch", *added, *map(shlex.quote, options), str(shown)])


class Submissions:
    """The jobs a notebook cell submits, all with a short time limit; when the cell is interrupted
    (Jupyter's stop button) or fails before they end, they are cancelled, not left in the queue.

        with slurm.Submissions(time_limit="00:15:00") as jobs:
            job = jobs.sbatch(script, env={...})
        print(jobs.command_line(script, env={...}))   # the same submission, as a command to paste
    """

    def __init__(self, time_limit: str = TIME_LIMIT):
        self.time_limit = time_limit
        self.ids: list[int] = []

    def sbatch(self, script: str | Path, *options: str, env: dict[str, str] | None = None) -> int:
        """Submit, printing the command a learner would type (paths relative to the repository, ``env`` in
        front) and the job's id."""
        job = sbatch(script, f"--time={self.time_limit}", *options, env=env)
        self.ids.append(job)
        print(f"$ {self.command_line(script, *options, env=_relative(env))}\nSubmitted batch job {job}", flush=True)
        return job

    def add(self, job_id: int | str) -> int:
        """A job submitted another way (submitit's executor), cancelled with the others if the cell stops."""
        self.ids.append(int(job_id))
        return int(job_id)

    def command_line(self, script: str | Path, *options: str, env: dict[str, str] | None = None) -> str:
        """What :meth:`sbatch` would submit, as a shell command."""
        return command_line(script, *options, env=env, time_limit=self.time_limit)

    def __enter__(self) -> "Submissions":
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.ids:
            live = [j for j in self.ids if any(r.get("JobState") not in FINAL_STATES for r in job_records(j))]
            if live:
                subprocess.run(["scancel", *map(str, live)], capture_output=True)
                print(f"cancelled job(s) {', '.join(map(str, live))}: the cell stopped before they ended")
        return False


def _relative(env: dict[str, str] | None) -> dict[str, str] | None:
    """``env`` with the repository's absolute paths written relative to it, as a learner at its root types them."""
    from .show import relative

    return {k: relative(str(v)) for k, v in env.items()} if env else env


# The practice cluster's nodes are network namespaces with no reverse DNS: c10d warns of it on every rank.
_PRACTICE_NOISE = "The hostname of the client socket cannot be retrieved"


def script_lines(log: str) -> str:
    """A job's log as its script printed it: without the practice cluster's c10d warning on every rank."""
    return "\n".join(line for line in log.splitlines() if _PRACTICE_NOISE not in line)


def sbatch(script: str | Path, *options: str, env: dict[str, str] | None = None) -> int:
    """Submit ``script`` (from the repository root, as the scripts expect); the job id.

    On the course's test cluster every process of the job gets one thread (``OMP_NUM_THREADS=1``, unless
    ``env`` says otherwise): its "nodes" share this machine's few cores, not the cores Slurm grants them.
    """
    threads = {"OMP_NUM_THREADS": "1"} if cluster_name() == TEST_CLUSTER else {}
    cmd = ["sbatch", "--parsable", *options, str(script)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO_ROOT,
                         env={**os.environ, **threads, **(env or {})})
    if out.returncode != 0:
        raise SlurmError(f"{' '.join(cmd)}: {out.stderr.strip()}")
    return int(out.stdout.strip().split(";")[0])


def job_records(job_id: int) -> list[dict[str, str]]:
    """``scontrol show job`` as one dict per job (an array gives one per task)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True)
    if out.returncode != 0:
        return []
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.stdout.strip().splitlines() if line]


def job_states(records: dict[int, list[dict[str, str]]]) -> str:
    """One line of where each job stands: its state (an array's tasks counted by state), and why a pending job
    waits (Slurm's Reason: Priority, Resources, ...), the long part on a busy cluster."""
    parts = []
    for job, recs in records.items():
        states = [r.get("JobState", "?") for r in recs] or ["not known to Slurm"]
        counts = {state: states.count(state) for state in dict.fromkeys(states)}
        text = ", ".join(f"{n} {state}" if len(states) > 1 else state for state, n in counts.items())
        reasons = sorted({r.get("Reason") for r in recs if r.get("JobState") == "PENDING"} - {None, "None"})
        parts.append(f"job {job} {text}" + (f" ({', '.join(reasons)})" if reasons else ""))
    return "; ".join(parts)


def wait(job_ids: list[int], timeout_s: float = 600, poll_s: float = 1.0) -> dict[int, list[dict[str, str]]]:
    """Poll until every job (and array task) has ended; their final records. Where they stand is one line that
    changes as they do (:func:`job_states`: in place in a notebook, a line per change elsewhere)."""
    from .progress import StatusLine

    records: dict[int, list[dict[str, str]]] = {}
    shown, start = "", time.monotonic()

    def all_ended() -> dict[int, list[dict[str, str]]] | None:
        nonlocal shown
        records.update({j: job_records(j) for j in job_ids})
        ended = all(recs and all(r.get("JobState") in FINAL_STATES for r in recs) for recs in records.values())
        now = job_states(records)
        if not ended and now != shown:
            status(f"{now} (after {time.monotonic() - start:.0f} s)")
            shown = now
        return records if ended else None

    def still_running() -> SlurmError:
        return SlurmError(f"jobs not finished after {timeout_s:.0f} s: {job_states(records)}")

    with StatusLine() as status:
        return wait_until(all_ended, timeout_s, still_running, interval_s=poll_s)


def squeue() -> str:
    out = subprocess.run(["squeue", "-o", "%.10i %.9P %.28j %.8T %.6D %R"], capture_output=True, text=True)
    return out.stdout


def signal_batch(job_id: int, sig: str = "USR1") -> None:
    """Send a signal to a job's batch shell, as ``--signal=B:SIG@t`` does near the time limit."""
    subprocess.run(["scancel", f"--signal={sig}", "--batch", str(job_id)], check=True)


def wait_requeued(job_id: int, timeout_s: float = 120) -> None:
    """Wait until a job has been requeued: restart count grown and back in the queue.

    On the way it passes through CANCELLED ("due to job requeue"), which must
    not be mistaken for the end of the job.
    """
    rec: dict[str, str] = {}

    def requeued() -> bool:
        rec.clear()
        rec.update((job_records(job_id) or [{}])[0])
        return rec.get("Restarts", "0") != "0" and rec.get("JobState") == "PENDING"

    wait_until(requeued, timeout_s, lambda: SlurmError(
        f"job {job_id} was not requeued within {timeout_s:.0f} s: {rec.get('JobState')}"), interval_s=0.5)


def release(job_id: int, delay_s: int = 3) -> None:
    """Let a requeued job start in ``delay_s`` seconds, rather than at the later BeginTime Slurm
    gave it (notebook 05 prints how far off that is).

    Not at once: when a job ends, slurmd revokes its credential with a time stamp
    of one-second resolution, and a new start of the same job allocated within
    that second is killed as "Job credential revoked" (the job then ends FAILED,
    exit 1:0, after one restart). The margin keeps the restart out of that second.
    """
    subprocess.run(["scontrol", "update", f"JobId={job_id}", f"StartTime=now+{delay_s}"], check=True)


def sbatch_options(script: str | Path) -> dict[str, str]:
    """The ``#SBATCH --key=value`` lines of a batch script."""
    return parse_sbatch_options(Path(script).read_text())


SHORT_OPTIONS = {"-N": "--nodes", "-n": "--ntasks", "-c": "--cpus-per-task", "-t": "--time", "-J": "--job-name",
                 "-p": "--partition", "-o": "--output", "-A": "--account"}


def parse_sbatch_options(text: str) -> dict[str, str]:
    """The ``#SBATCH`` options of a batch script's text, as ``--key: value`` (a later line wins, as in sbatch):
    ``--key=value``, ``--key value`` and the short forms (``-c 4``, ``-N2``) alike."""
    options = {}
    for line in text.splitlines():
        if not line.startswith("#SBATCH "):
            continue
        words = line[len("#SBATCH "):].split("#", 1)[0].split()
        if not words:
            continue
        if words[0].startswith("--"):
            key, value = (words[0].split("=", 1) + [None])[:2]
        else:  # -c 4, -N2
            key, value = words[0][:2], words[0][2:]
        key = SHORT_OPTIONS.get(key, key)
        value = value or (words[1] if len(words) > 1 else "")
        options[key] = value
    return options


def site_scripts(pattern: str = "multi_node_srun") -> dict[str, tuple[int, int, dict[str, str]]]:
    """Per site in ``slurm/sites/``: GPUs and cores per node, and the ``#SBATCH`` options of
    the script ``slurm/generate.py`` wrote for ``pattern``."""
    sites = {}
    for conf_path in sorted((REPO_ROOT / "slurm" / "sites").glob("*.toml")):
        conf = tomllib.loads(conf_path.read_text())
        script = REPO_ROOT / "slurm" / conf_path.stem / f"{pattern}.sbatch"
        sites[conf_path.stem] = (conf["gpus_per_node"], conf["cores_per_node"], sbatch_options(script))
    return sites
