"""Notebooks 04-05: an sbatch script to repair, how often to checkpoint."""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping

from .core import WrongAnswer, _close, passed


# --------------------------------------------------------------------------- #
# 04: an sbatch script to repair
# --------------------------------------------------------------------------- #
def colleagues_attempt(one_file: str, gpus: int, cores: int) -> str:
    """Notebook 04's one-file sbatch as a colleague adapted it to nodes of ``gpus`` GPUs and ``cores`` cores. What is
    wrong with it is the exercise (the reference repair is in course_utils.solutions)."""
    lines, out = one_file.splitlines(), []
    for k, line in enumerate(lines):
        if line.startswith("#SBATCH --ntasks-per-node="):
            line = f"#SBATCH --ntasks-per-node=1        # ... one task on each, for its {gpus} GPUs"
        elif line.startswith("#SBATCH --cpus-per-task="):
            line = f"#SBATCH --cpus-per-task={cores}         # all {cores} cores of the node"
        elif line.startswith("#SBATCH --gres=gpu:"):
            line = f"#SBATCH --gres=gpu:{gpus}               # ... and their {gpus} GPUs"
        elif line.startswith("#SBATCH --job-name="):
            line = "#SBATCH --job-name=ddp-frontera"
        elif "SRUN_CPUS_PER_TASK" in line or line.startswith("export MASTER_ADDR"):
            while out and out[-1].startswith("# ") and "shellcheck" not in out[-1]:
                out.pop()  # its comment goes with it
            continue
        out.append(line)
    attempt = "\n".join(out) + "\n"
    if attempt.count("\n") != len(lines) - 4 or "--ntasks-per-node=1 " not in attempt or "--gres=gpu:" not in attempt:
        raise RuntimeError("notebook 04's exercise starts from slurm/ddp_one_file.sbatch's lines, which changed: "
                           "update course_utils.exercises.colleagues_attempt with them")
    return attempt


def _tasks_environment(script: str, cpus_per_task: str) -> tuple[dict[str, str], list[str]]:
    """Run the script's shell lines with Slurm's commands replaced by stand-ins: the environment its srun would
    hand to the tasks (what the batch shell exported), and srun's own options."""
    import subprocess
    import tempfile

    stand_ins = ('scontrol() { printf "c123-001\\nc123-002\\n"; }\n'
                 "hostname() { echo c123-001; }\n"  # the batch shell runs on the job's first node
                 "source() { :; }\n"  # the environment's activation
                 'srun() { printf "SRUN_ARG=%s\\n" "$@"; '
                 'env | grep -E "^(MASTER_ADDR|MASTER_PORT|SRUN_CPUS_PER_TASK)=" || true; }\n')
    with tempfile.TemporaryDirectory() as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "SLURM_JOB_NODELIST": "c123-[001-002]",
               "SLURM_JOB_ID": "4242",
               "SLURM_CPUS_PER_TASK": cpus_per_task, "HOME": tmp}
        run = subprocess.run(["bash", "-c", stand_ins + script], capture_output=True, text=True, env=env,
                             cwd=tmp, timeout=30)
    if run.returncode:
        raise WrongAnswer(f"the script's shell lines fail (exit {run.returncode}): {run.stderr.strip()[-300:]}")
    args = [line[len("SRUN_ARG="):] for line in run.stdout.splitlines() if line.startswith("SRUN_ARG=")]
    lines = run.stdout.splitlines()
    handed = dict(line.split("=", 1) for line in lines if "=" in line and not line.startswith("SRUN_ARG="))
    # srun's own options, up to the command it starts, hand the tasks the same: -c N, --export=ALL,VAR=value
    valued = {"-c", "--cpus-per-task", "-n", "--ntasks", "-N", "--nodes", "--export", "-w", "--nodelist", "-x",
              "--exclude", "-p", "--partition", "--ntasks-per-node"}
    k = 0
    while k < len(args) and args[k].startswith("-"):
        arg, value = (args[k].split("=", 1) + [None])[:2] if args[k].startswith("--") else (args[k][:2], args[k][2:])
        if not value and arg in valued and k + 1 < len(args):
            k, value = k + 1, args[k + 1]
        if arg in ("-c", "--cpus-per-task"):
            handed.setdefault("SRUN_CPUS_PER_TASK", value)
        elif arg == "--export":
            handed.update(kv.split("=", 1) for kv in value.split(",") if "=" in kv)
        k += 1
    return handed, args


def check_sbatch_repair(repair: Callable[[str], str], attempt: str, gpus: int, cores: int,
                        site_options: Mapping[str, str]) -> None:
    """``repair(attempt)`` -> the script, repaired as the srun pattern: one rank per GPU started by srun, each with
    its share of the cores (as ``slurm/generate.py`` wrote the site's script, ``site_options``), and every variable
    the ranks need handed to them. Judged by parsing its ``#SBATCH`` lines and running its shell lines with Slurm's
    commands replaced by stand-ins."""
    import subprocess

    from ..slurm import parse_sbatch_options

    script = repair(attempt)
    syntax = subprocess.run(["bash", "-n"], input=script, capture_output=True, text=True)
    if syntax.returncode:
        raise WrongAnswer(f"bash cannot parse the script: {syntax.stderr.strip()}")
    options = parse_sbatch_options(script)
    tasks, cpus = options.get("--ntasks-per-node", "1"), options.get("--cpus-per-task", "1")
    if options.get("--nodes") != "2":
        raise WrongAnswer(f"--nodes={options.get('--nodes')}: the job is for 2 nodes")
    if tasks != str(gpus):
        raise WrongAnswer(f"--ntasks-per-node={tasks}: srun starts that many ranks per node, and NCCL drives one "
                          f"GPU per rank: {gpus} GPUs per node")
    gres = options.get("--gres") or options.get("--gpus-per-node") or ""
    if gres and gres.split(":")[-1] != str(gpus):
        raise WrongAnswer(f"{gres}: the job asks for {gres.split(':')[-1]} GPUs a node, and its nodes have {gpus}, "
                          "one for each rank")
    if cpus != site_options["--cpus-per-task"]:
        raise WrongAnswer(f"--cpus-per-task={cpus} for {tasks} tasks on a node of {cores} cores: "
                          f"slurm/generate.py's script asks for {site_options['--cpus-per-task']}")
    handed, args = _tasks_environment(script, cpus)
    if not args:
        raise WrongAnswer("the script's shell lines never reach srun: it starts the ranks")
    if handed.get("SRUN_CPUS_PER_TASK") != cpus:
        raise WrongAnswer(f"srun hands each task {handed.get('SRUN_CPUS_PER_TASK') or 'no'} SRUN_CPUS_PER_TASK: since "
                          "Slurm 22.05 srun no longer passes --cpus-per-task on, so every rank would share one core")
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not handed.get(v)]
    if missing:
        raise WrongAnswer(f"srun's tasks do not get {' and '.join(missing)}: a variable the batch shell sets "
                          "reaches srun's tasks only when it is exported")
    if handed["MASTER_ADDR"] != "c123-001":
        raise WrongAnswer(f"MASTER_ADDR={handed['MASTER_ADDR']}: rank 0 runs on the first node of the job's node list")
    passed(f"{options['--nodes']} nodes x {tasks} ranks, {cpus} cores each, the rendezvous and the cores handed on. "
           f"What the attempt got wrong: one task per node starts one rank, which drives one of the node's {gpus} GPUs; "
           f"{gpus} tasks of {cores} cores each ask for {gpus * cores} cores on a {cores}-core node, which Slurm refuses; "
           "without SRUN_CPUS_PER_TASK every rank and its DataLoader workers share one core; and variables set but not "
           "exported never reach srun's tasks, so init_process_group finds no MASTER_ADDR")


# --------------------------------------------------------------------------- #
# 05: how often to checkpoint
# --------------------------------------------------------------------------- #
INTERVAL_CASES = ((10.0, 3600.0), (30.0, 86_400.0 * 30 / 512), (0.05, 86_400.0), (120.0, 86_400.0 * 7))
"""(seconds per checkpoint write, mean time between failures): a node failing hourly, a month's node MTBF over 512
nodes, this course's small model on a laptop, a large model's state on a shared file system with a week's MTBF."""


def check_best_interval(interval: Callable[[float, float], float], write_s: float) -> None:
    """``interval(write_s, mtbf_s)``: the checkpoint interval that wastes least, judged against the interval that
    minimises writing time plus expected lost work (on this machine's ``write_s`` and on other cases)."""
    cases = [(write_s, m) for m in (3600.0, 86_400.0)] + list(INTERVAL_CASES)
    for w, m in cases:
        got, want = float(interval(w, m)), math.sqrt(2 * w * m)
        if not _close(got, want, 0.1):
            waste = lambda t: w / t + t / (2 * m)  # noqa: E731  (the expected share of the run wasted)
            said = f"{waste(got):.2%}" if got > 0 and math.isfinite(got) else "no checkpoint at all"
            raise WrongAnswer(f"a write of {w:g} s, a failure every {m / 3600:,.1f} h on average: you say every "
                              f"{got:,.0f} s, which wastes {said} of the run; the best interval wastes "
                              f"{waste(want):.2%}. What does one failure cost on average, and how often does it come?")
    passed("the interval where writing and expected lost work cost the same. A failure loses half an interval on "
           "average, so the interval grows only as the square root of the write time and of the time between failures "
           "(Young, 1974): a job on 512 nodes fails 512 times as often as one node and checkpoints about 23 times as "
           "often")
