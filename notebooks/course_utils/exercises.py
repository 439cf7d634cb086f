"""The notebooks' exercises: a cell for the learner, a checker that judges it against the run.

A learner's cell defines a function and marks it with :func:`exercise`::

    @exercise("ring_bytes")
    def ring_bytes(nbytes: int, world: int) -> float:
        raise NotImplementedError("bytes one rank sends in a ring all-reduce of nbytes")

Until it is filled, calling it stops Run All there with :class:`ExerciseNotDone`
(what to do, not the answer). The next cell hands it to a checker below, which
compares the answer with what the notebook measured and says why a wrong one
is wrong. With ``COURSE_SOLUTIONS=1`` (what the test suite sets) the reference
solution in :mod:`course_utils.solutions` runs instead, through the same checker.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

SOLUTIONS_VAR = "COURSE_SOLUTIONS"


class ExerciseNotDone(Exception):
    """The learner's cell still raises NotImplementedError."""


class WrongAnswer(AssertionError):
    """The checker's verdict on a wrong answer, with the reason."""


def solutions_enabled() -> bool:
    return os.environ.get(SOLUTIONS_VAR, "").strip() == "1"


def exercise(name: str) -> Callable[[F], F]:
    """Mark the learner's function for exercise ``name`` (see the module's docstring)."""

    def mark(fn: F) -> F:
        if solutions_enabled():
            from . import solutions

            return getattr(solutions, name)

        @functools.wraps(fn)
        def learner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except NotImplementedError as exc:
                raise ExerciseNotDone(
                    f"Exercise '{name}' is yours to write: {exc}. Replace the `raise NotImplementedError` "
                    "in the cell above with your code, run that cell, then this one; the check says whether "
                    "your answer matches this run's measurements."
                ) from None

        return learner  # type: ignore[return-value]

    return mark


def _close(got: float, want: float, rel: float) -> bool:
    return math.isfinite(got) and abs(got - want) <= rel * abs(want) + 1e-9


def passed(message: str) -> None:
    print(f"correct: {message}")


# --------------------------------------------------------------------------- #
# 01: gradient accumulation
# --------------------------------------------------------------------------- #
def check_accumulation(plan: Callable[[int, int], tuple[int, int]], steps: Mapping[str, int] | None = None) -> None:
    """``plan(global_batch, fits)`` -> ``(micro_batch, grad_accum)``: the global batch kept,
    no micro-batch larger than what fits, as few micro-steps as that allows. ``steps``: the
    optimiser steps the notebook measured for the big batch and for the plan (equal if right)."""
    for global_batch, fits in ((128, 32), (256, 256), (96, 40), (512, 48)):
        micro, accum = plan(global_batch, fits)
        if micro * accum != global_batch:
            raise WrongAnswer(f"for a global batch of {global_batch}, {micro} x {accum} = {micro * accum} images "
                              "reach one optimiser step: the learning rate was tuned for the global batch")
        if micro > fits:
            raise WrongAnswer(f"a micro-batch of {micro} does not fit where at most {fits} do (out of memory)")
        fewest = min(a for a in range(1, global_batch + 1) if global_batch % a == 0 and global_batch // a <= fits)
        if accum != fewest:
            raise WrongAnswer(f"{accum} micro-steps for {global_batch} with {fits} fitting: {fewest} would do, and "
                              "each extra one is a forward and backward pass on a smaller, less efficient batch")
    if steps is not None and steps["big batch"] != steps["accumulated"]:
        raise WrongAnswer(f"the runs took {steps['big batch']} and {steps['accumulated']} optimiser steps: "
                          "the same global batch must give the same number of updates")
    passed("the global batch is kept, every micro-batch fits, and the optimiser took the same number of steps")


def accumulation_gap(model: Any, global_batch: int = 8, micro_batch: int = 2, image: tuple = (3, 32, 32)) -> float:
    """One step's gradient from a batch of ``global_batch`` against the same images as micro-batches whose
    gradients are added (each loss scaled by its share): the largest difference, relative to the largest
    gradient, on the CPU, in float64 so that rounding stays far below what a model can make of it."""
    import copy

    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    x, y = torch.randn(global_batch, *image, dtype=torch.float64), torch.randint(0, 10, (global_batch,))
    whole, parts = copy.deepcopy(model).double().cpu().train(), copy.deepcopy(model).double().cpu().train()
    F.cross_entropy(whole(x), y).backward()
    for xs, ys in zip(x.split(micro_batch), y.split(micro_batch)):
        (F.cross_entropy(parts(xs), ys) * len(xs) / global_batch).backward()
    a = torch.cat([p.grad.flatten() for p in whole.parameters()])
    b = torch.cat([p.grad.flatten() for p in parts.parameters()])
    return ((a - b).abs().max() / a.abs().max()).item()


def check_accumulation_exact(is_exact: Callable[[Any], bool], models: Mapping[str, Any],
                             image: tuple = (3, 32, 32)) -> dict[str, float]:
    """``is_exact(model)``: whether accumulated micro-batches give exactly the global batch's gradient, judged
    by measuring one step both ways (:func:`accumulation_gap`) on each of ``models``. Returns the gaps."""
    gaps = {name: accumulation_gap(model, image=image) for name, model in models.items()}
    for name, model in models.items():
        exact, said = gaps[name] < 1e-9, is_exact(model)
        if not isinstance(said, bool):
            raise WrongAnswer(f"{name}: return True or False, not {said!r}")
        if said != exact:
            raise WrongAnswer(f"{name}: you say {'exact' if said else 'not exact'}; one step measured both ways "
                              f"differs by {gaps[name]:.1e} of the largest gradient. Which of its layers look at "
                              "more than one image at a time?")
    passed(", ".join(f"{name} {'exact' if g < 1e-9 else f'off by {g:.0e}'}" for name, g in gaps.items()))
    return gaps


# --------------------------------------------------------------------------- #
# 02: what a ring all-reduce sends
# --------------------------------------------------------------------------- #
def check_ring_bytes(formula: Callable[[int, int], float], measured: Sequence[Mapping[str, float]]) -> None:
    """``formula(nbytes, world)`` against the bytes the hand-written ring counted as it sent them
    (rows of ``world``, ``nbytes``, ``sent_per_rank``), then against world sizes not measured here."""
    for row in measured:
        got, want = formula(int(row["nbytes"]), int(row["world"])), row["sent_per_rank"]
        if not _close(got, want, 0.01):
            raise WrongAnswer(f"{row['world']} ranks, {row['nbytes']:,.0f} bytes: your formula says {got:,.0f} bytes "
                              f"per rank, the ring sent {want:,.0f}")
    for world in (4, 8, 64):
        got, want = formula(2**20, world), 2 * (world - 1) / world * 2**20
        if not _close(got, want, 0.01):
            raise WrongAnswer(f"right for the runs here, but for {world} ranks: {got:,.0f} bytes where each rank "
                              f"sends 2(N-1) chunks of S/N = {want:,.0f}")
    passed("2(N-1)/N x S: under 2S per rank however many ranks there are")


# --------------------------------------------------------------------------- #
# 03: strong scaling
# --------------------------------------------------------------------------- #
def check_strong_efficiency(efficiency: Callable[[Sequence[Mapping[str, float]]], list[float]],
                            rows: Sequence[Mapping[str, float]]) -> None:
    """``efficiency(rows)``: per run, the 1-rank time over (N x the N-rank time), from rows
    with ``world_size`` and ``seconds`` for the same total work."""
    got = list(efficiency(rows))
    base = next(r["seconds"] for r in rows if r["world_size"] == 1)
    want = [base / (r["world_size"] * r["seconds"]) for r in rows]
    if len(got) != len(want):
        raise WrongAnswer(f"{len(got)} efficiencies for {len(want)} runs")
    for r, g, w in zip(rows, got, want):
        if not _close(g, w, 0.01):
            raise WrongAnswer(f"{r['world_size']} ranks: you say {g:.3f}, the times say {w:.3f} "
                              "(the total work is fixed, so ideal time at N ranks is T1/N)")
    passed("efficiency(N) = T1 / (N x TN), from this run's times")


# --------------------------------------------------------------------------- #
# 00: how large a file must be
# --------------------------------------------------------------------------- #
HALF_SPEED_CASES = ((1000.0, 64 * 1024, 100.0), (20_000.0, 16 * 1024, 2000.0), (300.0, 4096, 500.0))
"""(files/s, bytes per file, MiB/s of one large file): a slow shared file system, a fast local disk, a metadata
server far away; chosen so that each wrong model below misses at least one by far more than the tolerance."""


def _half_speed(files_per_s: float, file_bytes: int, big_mib_per_s: float) -> float:
    bandwidth = big_mib_per_s * 2**20
    return max(0.0, 1 / files_per_s - file_bytes / bandwidth) * bandwidth


def check_half_speed_size(size: Callable[[float, int, float], float],
                          measured: Mapping[str, Mapping[str, float]]) -> None:
    """``size(files_per_s, file_bytes, big_mib_per_s)``: bytes per file at which reading files runs at half
    one large file's speed; judged on each folder this run measured (``measured[folder]`` holds the
    three arguments) and on other storage."""
    cases = [(m["files_per_s"], int(m["file_bytes"]), m["big_mib_per_s"], f"{folder} (measured here)")
             for folder, m in measured.items()]
    cases += [(*c, "another file system") for c in HALF_SPEED_CASES]
    for files_per_s, file_bytes, big, where in cases:
        got, want = size(files_per_s, file_bytes, big), _half_speed(files_per_s, file_bytes, big)
        if not _close(float(got), want, 0.05) and not (want < 1024 and abs(float(got) - want) < 1024):
            share = float(got) / (float(got) + want) if float(got) > 0 else 0.0  # the speed files of that size reach
            raise WrongAnswer(f"{where}: {files_per_s:,.0f} files/s of {file_bytes / 1024:,.0f} KiB, one large file "
                              f"at {big:,.0f} MiB/s: by these rates, files of your {float(got) / 1024:,.1f} KiB "
                              f"would read at {share:.0%} of the large file's speed, not 50%. How much of a small "
                              "file's time is its bytes?")
    passed("a file costs a fixed time plus its bytes; at this size the two are equal")


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
        elif line.startswith("#SBATCH --job-name="):
            line = "#SBATCH --job-name=ddp-frontera"
        elif "SRUN_CPUS_PER_TASK" in line or line.startswith("export MASTER_ADDR"):
            while out and out[-1].startswith("# ") and "shellcheck" not in out[-1]:
                out.pop()  # its comment goes with it
            continue
        out.append(line)
    attempt = "\n".join(out) + "\n"
    if attempt.count("\n") != len(lines) - 4 or "--ntasks-per-node=1 " not in attempt:
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

    from .slurm import parse_sbatch_options

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
    passed(f"{options['--nodes']} nodes x {tasks} ranks, {cpus} cores each, the rendezvous and the cores handed on")


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
    passed("the interval where writing and expected lost work cost the same")


# --------------------------------------------------------------------------- #
# 06: the optimiser steps Lightning takes in an epoch
# --------------------------------------------------------------------------- #
STEP_CASES = ((1000, 32, 3, 4), (4096, 16, 4, 3), (2000, 48, 2, 5), (50_000, 128, 8, 1))


def _steps_per_epoch(n_train: int, batch_size: int, world_size: int, grad_accum: int) -> int:
    batches = (n_train // world_size) // batch_size  # the sampler's slice per rank, then whole batches only
    return -(-batches // grad_accum)  # Lightning also steps on the last, partial accumulation


def check_optimizer_steps(steps: Callable[[int, int, int, int], int], measured: Sequence[Mapping[str, int]]) -> None:
    """``steps(n_train, batch_size, world_size, grad_accum)``: optimiser steps in one epoch, against
    the ``global_step`` of the runs measured (rows of those four, ``epochs`` and ``global_step``),
    then against layouts not run here."""
    for row in measured:
        got = steps(row["n_train"], row["batch_size"], row["world_size"], row["grad_accum"]) * row["epochs"]
        if got != row["global_step"]:
            raise WrongAnswer(f"{row['n_train']} images, batch {row['batch_size']} per rank, {row['world_size']} "
                              f"rank(s), grad-accum {row['grad_accum']}, {row['epochs']} epoch(s): you say {got} "
                              f"optimiser steps, Lightning took {row['global_step']}")
    for case in STEP_CASES:
        got, want = steps(*case), _steps_per_epoch(*case)
        if got != want:
            raise WrongAnswer("right for the runs here, but for {} images, batch {}, {} ranks, grad-accum {}: {} "
                              "steps, not {}. Each rank gets n/world images (the remainder dropped), keeps whole "
                              "batches only (drop_last), and the last, partial accumulation still steps"
                              .format(*case, want, got))
    passed("one epoch: whole batches of each rank's slice, one step per grad-accum of them, the last one included")


# (parameters, ranks, GPU bytes) -> the smallest ZeRO stage whose model states fit: FT3's A100-40GB,
# 2 per node, on 1, 2 and 8 nodes, and a model too large for any stage
STAGE_CASES = {(1_500_000_000, 2, 40e9): 0, (3_000_000_000, 2, 40e9): 1, (6_000_000_000, 4, 40e9): 2,
               (20_000_000_000, 16, 40e9): 3, (70_000_000_000, 8, 40e9): None, (7_000_000_000, 1, 80e9): None}


def check_smallest_stage(smallest: Callable[[int, int, float], int | None],
                         measured: Sequence[Mapping[str, Any]]) -> None:
    """``smallest(psi, ranks, gpu_bytes)``: the lowest ZeRO stage whose params, gradients and Adam
    state (mixed precision) fit in ``gpu_bytes`` per rank, or None. Judged first against the runs:
    given exactly the bytes stage k measured per rank, the answer is stage k (a lower stage does not
    fit in them, stage k does); then against FT3-sized cases."""
    for row in sorted(measured, key=lambda r: r["zero_stage"]):
        got = smallest(row["psi"], row["world_size"], row["measured_bytes"])
        if got != row["zero_stage"]:
            raise WrongAnswer(f"{row['psi']:,} parameters on {row['world_size']} ranks with {row['measured_bytes']:,} "
                              f"bytes each (what stage {row['zero_stage']} measured per rank): you say stage {got}. "
                              "Bytes per parameter: 2 (bf16 weights) + 2 (bf16 gradients) + 12 (fp32 master, "
                              "two Adam moments); stage 1 divides the 12 by the ranks, stage 2 also the gradients' "
                              "2, stage 3 also the weights' 2")
    for (psi, ranks, gpu), want in STAGE_CASES.items():
        got = smallest(psi, ranks, gpu)
        if got != want:
            raise WrongAnswer(f"right for the runs here, but {psi / 1e9:g} B parameters on {ranks} rank(s) of "
                              f"{gpu / 1e9:g} GB: you say {got}, the answer is {want} (the lowest stage that fits "
                              "communicates least; None when even stage 3 does not fit)")
    passed("the lowest stage that fits: stage 0 when 16 bytes per parameter fit, else shard the optimizer, "
           "the gradients, the weights, in that order")


# (nodes, CPUs and GPUs per node, CPUs and GPUs per trial) -> trials Ray runs at once: FT3 (2 A100, 64 cores)
# and Frontera's rtx nodes (4 GPUs, 16 cores)
PACKING_CASES = {(2, 64, 2, 4, 0.5): 8, (2, 64, 2, 4, 0.4): 8, (1, 16, 4, 8, 0.25): 2, (3, 64, 2, 1, 1): 6,
                 (2, 3, 0, 2, 0): 2, (2, 64, 2, 8, 2): 2, (1, 16, 4, 4, 0.3): 4, (4, 16, 4, 2, 0): 32}


def check_trials_at_once(at_once: Callable[[int, float, float, float, float], int],
                         measured: Sequence[Mapping[str, float]]) -> None:
    """``at_once(nodes, node_cpus, node_gpus, trial_cpus, trial_gpus)``: how many trials Ray runs at the
    same time. Judged first against the searches of this run (the most trials seen training at once),
    then against FT3- and Frontera-sized cases."""
    for row in measured:
        args = (row["nodes"], row["cpus"], row["gpus"], row["trial_cpus"], row["trial_gpus"])
        got = at_once(*args)
        if got != row["most_at_once"]:
            raise WrongAnswer(f"{row['nodes']:g} node(s) of {row['cpus']:g} CPUs and {row['gpus']:g} GPUs, trials of "
                              f"{row['trial_cpus']:g} CPU and {row['trial_gpus']:g} GPU: you say {got}, and this run "
                              f"saw {row['most_at_once']:g} trials training at once")
    for args, want in PACKING_CASES.items():
        got = at_once(*args)
        if got != want:
            raise WrongAnswer(f"right for this run, but {args[0]} node(s) of {args[1]} CPUs and {args[2]} GPUs with "
                              f"trials of {args[3]} CPU and {args[4]} GPU: you say {got}, Ray runs {want}. Ray packs "
                              "each node on its own, the scarcer resource decides, and a fraction of a GPU never "
                              "spans two GPUs")
    passed("per node, the scarcer of CPUs and GPUs decides; a 0.4-GPU trial fits twice on a GPU, not 2.5 times")


# --------------------------------------------------------------------------- #
# 09: the interleaved pipeline's bubble
# --------------------------------------------------------------------------- #
# (stages, micro-batches, chunks per rank) -> the share of the step a rank waits
BUBBLE_CASES = {(2, 1, 1): 0.5, (4, 12, 1): 0.2, (8, 32, 4): 7 / 135, (4, 8, 2): 3 / 19, (16, 16, 8): 15 / 143,
                (1, 8, 2): 0.0}


def check_interleaved_bubble(bubble: Callable[[int, int, int], float], measured: Sequence[Mapping[str, Any]],
                             stages: int) -> None:
    """``bubble(stages, microbatches, chunks)``: the share of a pipeline step a rank waits when each of the
    ``stages`` ranks runs ``chunks`` model chunks. Judged against this run's timed steps, every schedule
    (within 0.05, plus what the sends and Python cost on top, measured apart: ``bare_s``), then exactly
    against layouts not run here."""
    for row in measured:
        got = bubble(stages, row["microbatches"], row.get("chunks", 1))
        slack = 0.05 + 3 * row["bare_s"] / row["step_s"]
        if not (math.isfinite(got) and abs(got - row["bubble"]) <= slack):
            raise WrongAnswer(f"{stages} ranks, {row['microbatches']} micro-batches, {row.get('chunks', 1)} chunk(s) per "
                              f"rank ({row['schedule']}): you say {got:.3f}, this run measured {row['bubble']:.3f}")
    for (p, m, v), want in BUBBLE_CASES.items():
        got = bubble(p, m, v)
        if not _close(got, want, 1e-9):
            hint = (" With v chunks a micro-batch's slot on a rank is v times shorter: how many of those short "
                    "slots does filling and draining the pipeline take, and how many does a rank work in?") if v > 1 else ""
            raise WrongAnswer(f"close to this run's measurements, but {p} ranks, {m} micro-batches, {v} chunk(s) per "
                              f"rank: you say {got:.4f}, the schedule idles {want:.4f} of the step.{hint}")
    passed("each rank works in v*m slots of 1/v of a micro-batch's time and the pipeline fills and drains in p-1 "
           "of them: (p-1)/(v*m+p-1); more chunks shrink the bubble at the price of v times the sends")



# --------------------------------------------------------------------------- #
# 10: DataLoader workers when a rank's cores run out
# --------------------------------------------------------------------------- #
# (worker_ms, compute_ms, cores of the rank) -> (workers, accelerator utilisation): ranks of Frontera's rtx nodes
# (16 cores, 4 GPUs: 4 cores a rank), of FT3 (64 cores, 2 GPUs: 32 a rank), and of smaller shares
PLAN_CASES = {(40.0, 5.0, 4): (3, 0.375), (40.0, 5.0, 32): (8, 1.0), (12.0, 30.0, 4): (1, 1.0),
              (30.0, 10.0, 4): (3, 1.0), (25.0, 4.0, 8): (7, 1.0), (25.0, 4.0, 6): (5, 0.8), (9.0, 2.0, 2): (1, 2 / 9)}
AU_SLACK = 0.25  # how far a measured utilisation may sit from the model's, the hand-over aside: the runs' noise on a
#                 loaded 2-core machine (a worker's time per batch moved by a third between runs there)


def _plan(worker_ms: float, compute_ms: float, cores: int) -> tuple[int, float]:
    wanted = math.ceil(worker_ms / compute_ms)  # k workers deliver k batches every worker_ms
    workers = max(1, min(wanted, cores - 1))  # a core is the training process's
    return workers, min(1.0, workers * compute_ms / worker_ms)


def check_plan_workers(plan: Callable[[float, float, int], tuple[int, float]],
                       measured: Sequence[Mapping[str, Any]]) -> None:
    """``plan(worker_ms, compute_ms, cores)`` -> (DataLoader workers to ask for on a rank with ``cores``
    cores, the accelerator utilisation they give in steady state), when one worker prepares a batch in
    ``worker_ms`` and a step computes for ``compute_ms``. Judged first against this run: each row of
    ``measured`` holds ``worker_ms``, ``compute_ms``, ``cores`` (this machine's), ``au``, the utilisation
    the DLIO method measured by number of workers, and ``handover_ms``, what taking a ready batch cost the
    training process (the model leaves it out: a measurement may fall short of the model by its share of a
    step); then exactly, against ranks not measured here."""
    for row in measured:
        w, c, cores = row["worker_ms"], row["compute_ms"], int(row["cores"])
        workers, au = plan(w, c, cores)
        want_workers, want_au = _plan(w, c, cores)
        if workers != want_workers:
            raise WrongAnswer(f"{w:.2f} ms per batch per worker, {c:.2f} ms of compute, {cores} cores: you ask for "
                              f"{workers} workers, it takes {want_workers}. "
                              + _workers_hint(workers, want_workers, w, c, cores))
        seen = row["au"].get(workers)
        short = row.get("handover_ms", 0.0) / (c + row.get("handover_ms", 0.0))  # what the hand-over may take off
        if seen is not None and not (math.isfinite(au) and au - short - AU_SLACK <= seen <= au + AU_SLACK):
            if abs(au - want_au) <= 1e-6:
                raise WrongAnswer(f"your model is the course's, but with {workers} workers and {c:.2f} ms of compute "
                                  f"this run measured a utilisation of {seen:.2f}, not {au:.2f}: something else used "
                                  "the cores during section 2 (look at the machine's load), or the model misses a "
                                  "cost here; run section 2 again")
            raise WrongAnswer(f"{workers} workers of {w:.2f} ms a batch and {c:.2f} ms of compute: you predict a "
                              f"utilisation of {au:.2f}, this run measured {seen:.2f}. In steady state the device "
                              "computes for compute_ms out of every max(compute_ms, the time the workers take to "
                              "deliver one batch)")
    for (w, c, cores), (want_workers, want_au) in PLAN_CASES.items():
        workers, au = plan(w, c, cores)
        if workers != want_workers:
            raise WrongAnswer(f"right for this machine, but a rank of {cores} cores, {w:g} ms per batch per worker and "
                              f"{c:g} ms of compute: you ask for {workers} workers, it takes {want_workers}. "
                              + _workers_hint(workers, want_workers, w, c, cores))
        if not (math.isfinite(au) and abs(au - want_au) <= 1e-6):
            raise WrongAnswer(f"right for this machine, but a rank of {cores} cores, {w:g} ms per batch per worker and "
                              f"{c:g} ms of compute, {workers} workers: you predict a utilisation of {au:.3f}, it is "
                              f"{want_au:.3f} ({workers} workers deliver a batch every {w / workers:g} ms; the device "
                              "cannot compute more than all of the time)")
    passed("ceil(worker_ms / compute_ms) workers where the cores allow, else one per core but the training "
           "process's; the device computes compute_ms out of every max(compute_ms, worker_ms / workers)")


def _workers_hint(got: Any, want: int, w: float, c: float, cores: int) -> str:
    if not isinstance(got, int) or isinstance(got, bool):
        return "a number of processes is a whole number (an int)"
    if got > cores - 1 and got > 1:
        return (f"the rank has {cores} cores and its training process needs one: more workers than "
                f"{max(1, cores - 1)} share cores and are each slower, they do not deliver more")
    if got < 1:
        return ("with 0 workers the training process reads each batch between steps and the device waits for "
                "every one: at least 1")
    if got < want:
        return (f"{got} workers deliver a batch every {w / got:.2f} ms; the device takes one every {c:.2f} ms, "
                f"and the rank has cores for {want}")
    return f"{want} already deliver a batch every compute_ms or sooner; each further worker costs a core and memory"


__all__ = [
    "ExerciseNotDone", "WrongAnswer", "check_accumulation", "check_accumulation_exact", "check_interleaved_bubble", "check_best_interval", "check_optimizer_steps",
    "check_ring_bytes", "check_half_speed_size", "check_smallest_stage", "check_sbatch_repair", "colleagues_attempt",
    "check_plan_workers", "check_strong_efficiency", "check_trials_at_once", "exercise", "solutions_enabled",
]
