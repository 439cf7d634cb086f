"""Each notebook's checker accepts the reference solution and rejects wrong answers; a learner's
unfilled cell stops with a message that says what to do, not the answer."""

import math

import pytest
import torch

from course_utils import exercises, slurm, solutions
from course_utils.exercises import ExerciseNotDone, WrongAnswer, exercise


def test_an_unfilled_exercise_stops_with_what_to_do(monkeypatch):
    monkeypatch.delenv("COURSE_SOLUTIONS", raising=False)

    @exercise("ring_bytes")
    def ring_bytes(nbytes, world):
        raise NotImplementedError("return the bytes one rank sends")

    with pytest.raises(ExerciseNotDone, match="Exercise 'ring_bytes' is yours to write: return the bytes"):
        ring_bytes(8, 2)


def test_the_solutions_knob_swaps_in_the_reference(monkeypatch):
    monkeypatch.setenv("COURSE_SOLUTIONS", "1")

    @exercise("ring_bytes")
    def ring_bytes(nbytes, world):
        raise NotImplementedError

    assert ring_bytes is solutions.ring_bytes


MEASURED_RING = [{"world": 2, "nbytes": 4096, "sent_per_rank": 4096.0},
                 {"world": 3, "nbytes": 3000, "sent_per_rank": 4000.0}]


@pytest.mark.parametrize("wrong", [
    lambda s, n: 2 * s,                   # the limit, not the count
    lambda s, n: (n - 1) / n * s,         # only the reduce-scatter half
    lambda s, n: 2 * (n - 1) * s,         # whole buffers, not chunks
])
def test_ring_bytes_checker(wrong):
    exercises.check_ring_bytes(solutions.ring_bytes, MEASURED_RING)
    with pytest.raises(WrongAnswer):
        exercises.check_ring_bytes(wrong, MEASURED_RING)


@pytest.mark.parametrize("wrong", [
    lambda g, f: (f, 1),                        # fits, but the global batch shrank
    lambda g, f: (g, 1),                        # the global batch, but it does not fit
    lambda g, f: (1, g),                        # right but needlessly slow
])
def test_accumulation_checker(wrong):
    exercises.check_accumulation(solutions.accumulation, {"big batch": 8, "accumulated": 8})
    with pytest.raises(WrongAnswer):
        exercises.check_accumulation(wrong)
    with pytest.raises(WrongAnswer, match="same number of updates"):
        exercises.check_accumulation(solutions.accumulation, {"big batch": 8, "accumulated": 32})


WEAK = {1: 0.040, 2: 0.052}  # a 2-rank run as notebook 03 makes it: the all-reduce adds 12 ms


@pytest.mark.parametrize("wrong", [
    lambda t1, weak, n: t1 / n,                                   # ideal: the all-reduce forgotten
    lambda t1, weak, n: t1 / n + weak[n],                         # the weak step's compute counted twice
    lambda t1, weak, n: (t1 + weak[n] - weak[1]) / n,             # the all-reduce shrinking with the batch too
    lambda t1, weak, n: t1 * weak[n] / weak[1] / n,               # weak scaling's slowdown as a factor
    lambda t1, weak, n: t1,                                       # no speed-up at all
])
def test_strong_step_checker(wrong):
    exercises.check_strong_step(solutions.strong_step, 0.085, WEAK)
    with pytest.raises(WrongAnswer):
        exercises.check_strong_step(wrong, 0.085, WEAK)


@pytest.mark.parametrize("wrong", [
    lambda model: True,                                                        # accumulation is always exact
    lambda model: False,                                                       # never
    lambda model: not any("Norm" in type(m).__name__ for m in model.modules()),  # GroupNorm too
])
def test_accumulation_exact_checker(wrong):
    from course_utils.models import build_model

    models = {name: build_model(name) for name in ("cnn", "cnn-gn", "mlp")}
    gaps = exercises.check_accumulation_exact(solutions.accumulation_is_exact, models)
    assert gaps["cnn"] > 1e-3 and gaps["cnn-gn"] < 1e-12, "measured: BatchNorm's step differs, GroupNorm's does not"
    with pytest.raises(WrongAnswer):
        exercises.check_accumulation_exact(wrong, models)


# notebook 00's read rows on this machine's disk (16 KiB files, fsync'd, pages dropped)
READS = {"cwd": {"files_per_s": 9000.0, "file_bytes": 16 * 1024, "big_mib_per_s": 1800.0}}


def _wrong_size(per_file_and_bytes):
    return lambda f, b, big: per_file_and_bytes(1 / f, b, big * 2**20)


@pytest.mark.parametrize("wrong", [
    _wrong_size(lambda t, b, bw: t * bw),              # the file's whole time counted as its fixed cost
    _wrong_size(lambda t, b, bw: (t - b / bw) * bw / 2),  # half the fixed cost's bytes
    _wrong_size(lambda t, b, bw: 2 * (t - b / bw) * bw),  # twice
    _wrong_size(lambda t, b, bw: b / t),               # the small files' own bandwidth, in bytes/s
    lambda f, b, big: b,                               # the size measured
])
def test_half_speed_size_checker(wrong):
    exercises.check_half_speed_size(solutions.half_speed_size, READS)
    with pytest.raises(WrongAnswer):
        exercises.check_half_speed_size(wrong, READS)


@pytest.mark.parametrize("wrong", [
    lambda w, m: math.sqrt(w * m),             # a failure costs a whole interval, not half of one
    lambda w, m: 2 * math.sqrt(w * m),         # ... or writing counted twice
    lambda w, m: m / 2,                        # half the time between failures
    lambda w, m: math.sqrt(2 * w * m / 512),   # the MTBF divided again
    lambda w, m: 0.0,                          # never
])
def test_best_interval_checker(wrong):
    exercises.check_best_interval(solutions.best_interval, 0.03)
    with pytest.raises(WrongAnswer):
        exercises.check_best_interval(wrong, 0.03)


def test_the_replayed_failures_cost_what_the_model_says():
    """The notebook's measurement: a replay of random failures, whose waste is least near the model's interval."""
    from course_utils.failures import replay_failures

    w, m = 10.0, 3600.0
    best = solutions.best_interval(w, m)
    waste = {f: replay_failures(f * best, w, m, work_s=1000 * m)["waste"] for f in (0.5, 1, 2)}
    assert waste[1] < min(waste[0.5], waste[2])
    assert waste[1] == pytest.approx(w / best + best / (2 * m), rel=0.15)
    no_failures = replay_failures(100.0, 1.0, 1e12, work_s=1000.0)
    assert no_failures["lost"] == 0 and no_failures["writing"] == pytest.approx(10 / 1010)


def _fixed(*steps):
    """A repair that applies only some of the reference's fixes."""
    fixes = {"tasks": lambda t: t.replace("--ntasks-per-node=1 ", "--ntasks-per-node=4 "),
             "cores": lambda t: t.replace("--cpus-per-task=16 ", "--cpus-per-task=4 "),
             "srun cpus": lambda t: t.replace("\nsrun ", "\nexport SRUN_CPUS_PER_TASK=$SLURM_CPUS_PER_TASK\nsrun ", 1),
             "rendezvous": lambda t: t.replace("\nsrun ", "\nexport MASTER_ADDR MASTER_PORT\nsrun ", 1)}

    def repair(text):
        for step in steps:
            text = fixes[step](text)
        return text
    return repair


@pytest.mark.parametrize("wrong", [
    _fixed(),                                                   # as the colleague wrote it
    _fixed("tasks", "srun cpus", "rendezvous"),                 # 4 tasks of 16 cores on a 16-core node
    _fixed("tasks", "cores", "rendezvous"),                     # every rank on one core
    _fixed("tasks", "cores", "srun cpus"),                      # the ranks never find rank 0
    lambda t: _fixed("tasks", "cores", "srun cpus", "rendezvous")(t).replace(
        '$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)', "$SLURM_JOB_NODELIST"),  # a node list
    lambda t: solutions.repaired_sbatch(t).replace("then", "").replace("srun bash", "if srun bash"),  # no bash
    lambda t: solutions.repaired_sbatch(t).replace("\nsrun bash", "\n: srun bash"),             # no ranks started
    lambda t: _fixed("tasks", "cores", "rendezvous")(t).replace("\nsrun bash", "\nsrun -N 2 bash"),  # -N is not -c
    lambda t: solutions.repaired_sbatch(t).replace("--gres=gpu:4", "--gres=gpu:2"),  # half the node's GPUs
])
def test_sbatch_repair_checker(wrong):
    """The repair judged as the srun pattern; the same hand-over spelled as srun's options is right too."""
    from course_utils.paths import REPO_ROOT

    gpus, cores, options = slurm.site_scripts()["frontera"]
    attempt = exercises.colleagues_attempt((REPO_ROOT / "slurm" / "ddp_one_file.sbatch").read_text(), gpus, cores)
    exercises.check_sbatch_repair(solutions.repaired_sbatch, attempt, gpus, cores, options)
    exercises.check_sbatch_repair(lambda t: t.replace("MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\""
                                                      " | head -n 1)", "MASTER_ADDR=$(hostname)"),
                                  solutions.repaired_sbatch(attempt), gpus, cores, options)  # also right
    tasks_and_cores = _fixed("tasks", "cores")
    for also_right in (  # srun's own options hand the tasks the same; sbatch's other spellings of the options
            lambda t: tasks_and_cores(t).replace("\nsrun bash", "\nsrun -c $SLURM_CPUS_PER_TASK "
                                                 "--export=ALL,MASTER_ADDR=$MASTER_ADDR,MASTER_PORT=$MASTER_PORT bash"),
            lambda t: _fixed("rendezvous")(t).replace("--ntasks-per-node=1 ", "--ntasks-per-node 4 ").replace(
                "#SBATCH --cpus-per-task=16 ", "#SBATCH -c 4 ").replace("\nsrun bash",
                                                                       "\nsrun --cpus-per-task=4 bash")):
        exercises.check_sbatch_repair(also_right, attempt, gpus, cores, options)
    with pytest.raises(WrongAnswer):
        exercises.check_sbatch_repair(wrong, attempt, gpus, cores, options)


def test_a_learners_run_all_stops_at_the_exercise_with_what_to_do(monkeypatch, tmp_path):
    """Notebook 00 (seconds to run) as a learner gets it: Run All, no solutions."""
    nbclient = pytest.importorskip("nbclient")
    import nbformat

    from course_utils.paths import REPO_ROOT

    monkeypatch.setenv("COURSE_SOLUTIONS", "0")
    monkeypatch.setenv("COURSE_PROFILE", "ci")
    nb = nbformat.read(REPO_ROOT / "notebooks" / "00_environment.ipynb", as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    with pytest.raises(nbclient.exceptions.CellExecutionError) as err:
        client.execute()
    assert err.value.ename == "ExerciseNotDone" and "is yours to write" in err.value.evalue
    ran = [c for c in nb.cells if c.cell_type == "code" and c.get("execution_count")]
    assert "check_half_speed_size(" in ran[-1].source, "it stops at the check, after every lesson cell ran"


MEASURED_STEPS = [{"n_train": 1040, "batch_size": 32, "world_size": 2, "grad_accum": 3, "epochs": 1, "global_step": 6},
                  {"n_train": 1024, "batch_size": 32, "world_size": 2, "grad_accum": 1, "epochs": 2,
                   "global_step": 32}]


def _step_every_batch(fabric, model, optimizer, loader, accumulate):
    for x, y in loader:
        fabric.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
    return len(loader)


def _accumulating(fabric, model, optimizer, loader, accumulate, last_steps=True, sync="boundary", count=None):
    steps = 0
    for i, (x, y) in enumerate(loader):
        boundary = (i + 1) % accumulate == 0 or (last_steps and i + 1 == len(loader))
        skip_sync = {"boundary": not boundary, "always": False, "inverted": boundary}[sync]
        with fabric.no_backward_sync(model, enabled=skip_sync):
            fabric.backward(torch.nn.functional.cross_entropy(model(x), y) / accumulate)
        if boundary:
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    return steps if count is None else count(len(loader), accumulate)


def _unwritten(fabric, model, optimizer, loader, accumulate):
    raise NotImplementedError("return the optimiser steps of one epoch")


def test_fabric_epoch_checker_runs_the_loop_on_two_ranks_and_rejects_wrong_ones(monkeypatch):
    """The reference passes on Lightning's layout and the others; each wrong loop is caught by what it got wrong."""
    exercises.check_fabric_epoch(solutions.fabric_epoch, MEASURED_STEPS)
    for wrong, said in ((_step_every_batch, "optimiser steps, not"),
                        (lambda *a: _accumulating(*a, last_steps=False), "the last, shorter group steps too"),
                        (lambda *a: _accumulating(*a, sync="always"), "all-reduced their gradients"),
                        (lambda *a: _accumulating(*a, sync="inverted"), "all-reduced their gradients"),
                        (lambda *a: _accumulating(*a, count=lambda batches, acc: batches // acc), "your function says"),
                        (_unwritten, "raised on a rank: NotImplementedError")):
        with pytest.raises(WrongAnswer, match=said):
            exercises.check_fabric_epoch(wrong, MEASURED_STEPS)
    monkeypatch.delenv("COURSE_SOLUTIONS", raising=False)  # the cell as it is handed out
    with pytest.raises(ExerciseNotDone, match="'fabric_epoch' is yours to write"):
        exercises.check_fabric_epoch(exercise("fabric_epoch")(_unwritten), MEASURED_STEPS)


PSI = 3_946_506
# what section 3 measured per rank on 2 ranks (bf16, padding included), and section 4's fp32 run of stage 2
MEASURED_STAGES = [{"zero_stage": s, "psi": PSI, "world_size": 2, "measured_bytes": b, "precision": "bf16"}
                   for s, b in ((0, 16 * PSI), (1, 10 * PSI + 12), (2, 9 * PSI + 14), (3, 8 * PSI))]
MEASURED_STAGES.append({"zero_stage": 2, "psi": PSI, "world_size": 2, "measured_bytes": 12 * PSI + 8,
                        "precision": "fp32"})


def _config(stage, precision):
    return {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": stage},
            **({"bf16": {"enabled": True}} if precision != "fp32" else {})}


def _first_fit(per_param, config=_config):
    """A wrong ds_config_for: the stage chosen from other bytes per parameter (weights, gradients, optimizer state;
    one triple for both precisions, or a dict by precision), or the configuration written another way."""
    def config_for(psi, ranks, gpu_bytes, precision):
        parts = per_param[precision] if isinstance(per_param, dict) else per_param
        for stage in range(4):
            sharded = parts[2] + (parts[1] if stage >= 2 else 0) + (parts[0] if stage >= 3 else 0)
            whole = sum(parts) - sharded if stage else sum(parts)
            if whole * psi + (sharded * psi / ranks if stage else 0) <= gpu_bytes:
                return config(stage, precision)
        return None
    return config_for


RIGHT = {"bf16": (2, 2, 12), "fp32": (4, 4, 12)}


@pytest.mark.parametrize("wrong", [
    lambda psi, ranks, gpu, precision: _config(3, precision),                            # always shard everything
    lambda psi, ranks, gpu, precision: _config(0, precision) if solutions.ds_config_for(psi, ranks, gpu, precision)
    else None,                                                                          # sharding ignored
    _first_fit({"bf16": (2, 2, 8), "fp32": (4, 4, 8)}),     # no fp32 master copy (8 bytes of Adam state)
    _first_fit({"bf16": (2, 2, 12), "fp32": (4, 4, 8)}),    # fp32 as the textbook counts it (zero_theory's fp32)
    _first_fit((2, 2, 12)),                                 # fp32 counted as bf16
    lambda psi, ranks, gpu, precision: next((_config(s, precision) for s in (3, 2, 1, 0)  # the highest that fits
                                             if solutions.ds_config_for(psi, ranks, gpu, precision) is not None), None),
    _first_fit(RIGHT, lambda stage, precision: {"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True},
                                                "zero_optimisation": {"stage": stage}}),  # misspelt: DeepSpeed reads 0
    _first_fit(RIGHT, lambda stage, precision: {"train_micro_batch_size_per_gpu": 16,
                                                "zero_optimization": {"stage": stage}}),  # no bf16 section: fp32
    _first_fit(RIGHT, lambda stage, precision: {"train_micro_batch_size_per_gpu": 16, "bf16": {"enabled": True},
                                                "zero_optimization": {"stage": stage}}),  # bf16 asked for an fp32 case
    _first_fit(RIGHT, lambda stage, precision: {**_config(stage, precision),
                                                "zero_optimization": {"stage": stage, "offload": True}}),  # refused
    _first_fit(RIGHT, lambda stage, precision: stage),                # the stage, not a configuration
])
def test_ds_config_checker(wrong):
    exercises.check_ds_config(solutions.ds_config_for, MEASURED_STAGES)
    with pytest.raises(WrongAnswer):
        exercises.check_ds_config(wrong, MEASURED_STAGES)


def test_the_ds_config_checker_judges_what_deepspeed_reads():
    """A fp16 configuration is mixed precision too; train_batch_size (checked against the ranks at initialize) is
    left out, so the config section 2 printed for 2 ranks is read as it stands."""
    from course_utils.config import TrainConfig
    from course_utils.sharding import ds_config

    printed = ds_config(TrainConfig(model="mlp", optimizer="adamw", batch_size=16, grad_accum=2), world=2, stage=2,
                        precision="bf16")
    assert exercises.deepspeed_reads(printed) == (2, True)
    assert exercises.deepspeed_reads({"train_micro_batch_size_per_gpu": 1, "fp16": {"enabled": True},
                                      "zero_optimization": {"stage": 1}}) == (1, True)


MEASURED_PACKING = [{"nodes": 1, "cpus": 2, "gpus": 0, "trial_cpus": 1, "trial_gpus": 0, "most_at_once": 2}]


@pytest.mark.parametrize("wrong", [
    lambda n, c, g, tc, tg: int(n * c // tc),                                    # GPUs ignored
    lambda n, c, g, tc, tg: int(min(n * c // tc, n * g // tg if tg else 10**9)),  # fractions spread over GPUs
    lambda n, c, g, tc, tg: int(min(n * c // tc, (n * g // tg) if tg else n * c // tc)) if n > 1
    else solutions.trials_at_once(n, c, g, tc, tg),                              # nodes pooled into one
    lambda n, c, g, tc, tg: int(n * (g // tg if tg else c // tc)),                # CPUs ignored when GPUs asked
])
def test_trials_at_once_checker(wrong):
    exercises.check_trials_at_once(solutions.trials_at_once, MEASURED_PACKING)
    with pytest.raises(WrongAnswer):
        exercises.check_trials_at_once(wrong, MEASURED_PACKING)


# train_pipeline.py's timed steps on 4 ranks (CPU, gloo, 20 ms of simulated compute per micro-batch and rank, a
# busy machine): the bubble, and the step with and without the simulated compute; interleaved: 2 chunks per rank
MEASURED_BUBBLE = [{"schedule": name, "chunks": v, "microbatches": m, "bubble": b, "step_s": s, "bare_s": bare}
                   for name, v, m, b, s, bare in (
                       ("gpipe", 1, 1, 0.762, 0.252, 0.006), ("gpipe", 1, 2, 0.624, 0.319, 0.017),
                       ("gpipe", 1, 4, 0.472, 0.454, 0.036), ("gpipe", 1, 8, 0.338, 0.725, 0.047),
                       ("gpipe", 1, 16, 0.247, 1.275, 0.106), ("interleaved", 2, 4, 0.394, 0.396, 0.037),
                       ("interleaved", 2, 8, 0.282, 0.668, 0.077), ("interleaved", 2, 16, 0.214, 1.221, 0.114))]


@pytest.mark.parametrize("wrong", [
    lambda p, m, v: (p - 1) / (m + p - 1),            # the chunks ignored: 1F1B's bubble
    lambda p, m, v: (p - 1) / (v * (m + p - 1)),      # the whole bubble divided by v, fill and drain too
    lambda p, m, v: (p - 1) / (v * m),                # against the useful work (Megatron-LM's form)
    lambda p, m, v: (p - 1) / (m + v * (p - 1)),      # v multiplies the wrong term
    lambda p, m, v: 0.2,                              # one measured row, hard-coded
])
def test_interleaved_bubble_checker(wrong):
    exercises.check_interleaved_bubble(solutions.interleaved_bubble, MEASURED_BUBBLE, 4)
    with pytest.raises(WrongAnswer):
        exercises.check_interleaved_bubble(wrong, MEASURED_BUBBLE, 4)


@pytest.fixture(scope="module")
def routed_text():
    """Notebook 12's layer and tokens: the standard library's first 4,096 bytes, embedded, through 8 experts."""
    import torch

    from course_utils.data.text import load_tokens
    from course_utils.parallel.experts import MoE

    torch.manual_seed(0)
    embedded = torch.nn.Embedding(256, 64)(load_tokens("stdlib", max_bytes=4096)).detach()
    return MoE(64, 176, experts=8, top_k=2), embedded


@pytest.mark.parametrize("wrong", [
    lambda load, n, e, k: 1.0,                                 # the even share: the busiest expert overflows
    lambda load, n, e, k: max(load) / (n / e),                 # top_k forgotten: twice what is needed
    lambda load, n, e, k: max(load) / (sum(load) / len(load)) + 0.2,  # rounded up generously
    lambda load, n, e, k: sum(load) / n,                       # assignments per token, not the busiest expert
    lambda load, n, e, k: None,                                # not a number
    lambda load, n, e, k: 2.1,                                 # this run's answer, hard-coded
    lambda load, n, e, k: round(max(load) / (n * k / e), 1),   # rounded: a capacity too large or too small
    lambda load, n, e, k: 1.03 * max(load) / (n * k / e),      # a margin on top
])
def test_no_drop_capacity_checker_routes_the_tokens_again_and_rejects_a_factor_too_small_or_too_large(routed_text,
                                                                                                    wrong):
    moe, tokens = routed_text
    exercises.check_no_drop_capacity(solutions.no_drop_capacity, moe, tokens)
    with pytest.raises(WrongAnswer):
        exercises.check_no_drop_capacity(wrong, moe, tokens)


class _SlowImages(torch.utils.data.Dataset):
    """Items that take ``item_s`` each to prepare: a worker's time per batch that a loaded machine does not move."""

    def __init__(self, n: int, item_s: float):
        self.n, self.item_s = n, item_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time

        time.sleep(self.item_s)
        return torch.zeros(3)


# a rank of 2 cores whose one worker prepares a batch of 4 in 8 ms (sleeps), beside 10 ms of compute: one worker
MEASURED_RANK = [{"worker_ms": 8.0, "compute_ms": 10.0, "cores": 2, "handover_ms": 0.5}]


def _reference(w, c, cores, h):
    k = max(1, min(math.ceil(w / (c + h)), cores - 1))
    return k, c / max(c + h, w / k)


def _as_loader(plan):  # a plan (workers, utilisation) as the loader the exercise returns
    return lambda data, batch, w, c, cores, h: (
        torch.utils.data.DataLoader(data, batch_size=batch, shuffle=True, num_workers=plan(w, c, cores, h)[0]),
        plan(w, c, cores, h)[1])


def _old_rule(w, c, cores, h):  # the rule of section 2 without the hand-over
    k = max(1, min(math.ceil(w / c), cores - 1))
    return k, min(1.0, k * c / w)


@pytest.mark.parametrize("wrong", [
    _as_loader(lambda w, c, cores, h: (max(1, math.ceil(w / (c + h))), 1.0)),         # the cores forgotten
    _as_loader(lambda w, c, cores, h: (max(1, min(math.ceil(w / (c + h)), cores)),   # no core for the training process
                                       c / max(c + h, w / max(1, min(math.ceil(w / (c + h)), cores))))),
    _as_loader(lambda w, c, cores, h: (_reference(w, c, cores, h)[0], 1.0)),         # the cap's cost forgotten
    _as_loader(lambda w, c, cores, h: (_reference(w, c, cores, h)[0], c / w)),       # as if one worker
    _as_loader(_old_rule),                                                           # the hand-over forgotten
    _as_loader(lambda w, c, cores, h: (_reference(w, c, cores, h)[0],                # the hand-over in the compute
                                       min(1.0, _reference(w, c, cores, h)[0] * (c + h) / w))),
    _as_loader(lambda w, c, cores, h: (max(1, min(math.floor(w / (c + h)), cores - 1)),  # rounded down
                                       c / max(c + h, w / max(1, min(math.floor(w / (c + h)), cores - 1))))),
    lambda data, batch, w, c, cores, h: (torch.utils.data.DataLoader(                  # not shuffled
        data, batch_size=batch, num_workers=_reference(w, c, cores, h)[0]), _reference(w, c, cores, h)[1]),
    lambda data, batch, w, c, cores, h: (torch.utils.data.DataLoader(                  # the batch size not followed
        data, batch_size=32, shuffle=True, num_workers=_reference(w, c, cores, h)[0]), _reference(w, c, cores, h)[1]),
    lambda data, batch, w, c, cores, h: _reference(w, c, cores, h),                    # no loader at all
])
def test_rank_loader_checker(wrong):
    data = _SlowImages(100, 0.002)
    exercises.check_rank_loader(solutions.rank_loader, data, 4, MEASURED_RANK)
    with pytest.raises(WrongAnswer):
        exercises.check_rank_loader(wrong, data, 4, MEASURED_RANK)


def test_rank_loader_checker_rejects_the_model_where_the_loader_measured_otherwise():
    """The check is also the lesson's: a loader slower than the row says fails the reference too."""
    slow = _SlowImages(100, 0.025)  # 100 ms a batch, where the row says 8
    with pytest.raises(WrongAnswer, match="your model is the course's"):
        exercises.check_rank_loader(solutions.rank_loader, slow, 4, MEASURED_RANK)


def test_tp_plan_checker_runs_each_plan_on_the_ranks_and_rejects_what_is_not_megatron_s_split():
    """One launch of scripts/tp_plan.py on 2 gloo ranks: the reference plan is Megatron's split (same output and input
    gradient, half the weights, one all-reduce forward); plans that fail, leave a layer whole or split none are not."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel as Col
    from torch.distributed.tensor.parallel import RowwiseParallel as Row

    wrong = {"up row-parallel": {"gate": Col(), "up": Row(), "down": Row()},
             "all column-parallel": {"gate": Col(), "up": Col(), "down": Col()},
             "down left whole": {"gate": Col(), "up": Col()},
             "gathered before down": {"gate": Col(output_layouts=Replicate()), "up": Col(output_layouts=Replicate())},
             "nothing split": {}}
    right, *rows = exercises.run_tp_plans([solutions.swiglu_plan(), *wrong.values()])
    assert exercises.tp_plan_verdict(right, 2) is None, right
    assert right["weight_share"] == 0.5 and right["forward"] == {"all_reduce": 1}, right
    for name, row in zip(wrong, rows, strict=True):
        assert exercises.tp_plan_verdict(row, 2), f"{name} passed: {row}"
    # what a run can report beside an error or a whole layer: wrong numbers, or collectives Megatron's split does not run
    assert "computes something else" in exercises.tp_plan_verdict({**right, "output_gap": 0.3}, 2)
    assert "forward pass ran" in exercises.tp_plan_verdict({**right, "forward": {"all_gather_into_tensor": 2}}, 2)
    for not_a_plan in ({"gate": "colwise"}, [Col(), Col(), Row()], {"fc1": Col(), "fc2": Row()}):
        with pytest.raises(WrongAnswer):
            exercises.check_tp_plan(lambda: not_a_plan)


def _space(base=None, batch=None, lr=None):
    """A search space like the reference, with one part written otherwise."""
    from ray import tune

    return lambda: {"_base_lr": base or tune.loguniform(1e-3, 1e-1), "batch_size": batch or tune.choice([32, 64, 128]),
                    "lr": lr or tune.sample_from(lambda config: config["_base_lr"] * config["batch_size"] / 32)}


def _wrong_spaces():
    from ray import tune

    return {
        "uniform base": _space(base=tune.uniform(1e-3, 1e-1)),
        "a decade too low": _space(base=tune.loguniform(1e-4, 1e-2)),
        "lr not scaled": _space(lr=tune.sample_from(lambda config: config["_base_lr"])),
        "scaled by the batch, not batch / 32": _space(lr=tune.sample_from(lambda config: config["_base_lr"] * config["batch_size"])),
        "batch from a range": _space(batch=tune.randint(32, 129)),
        "base from a few values": _space(base=tune.choice([1e-3, 1e-2, 1e-1])),
        "lr drawn on its own": _space(lr=tune.loguniform(1e-3, 4e-1)),
        "no lr key": lambda: {"_base_lr": tune.loguniform(1e-3, 1e-1), "batch_size": tune.choice([32, 64, 128])},
        "a key the trial does not read": lambda: {
            "base_lr": tune.loguniform(1e-3, 1e-1), "batch_size": tune.choice([32, 64, 128]),
            "lr": tune.sample_from(lambda config: config["base_lr"] * config["batch_size"] / 32)},
        "not a dict": lambda: [tune.loguniform(1e-3, 1e-1)],
    }


def test_search_space_checker_draws_with_tune_and_rejects_what_does_not_follow_the_rule():
    exercises.check_search_space(solutions.scaled_lr_space)
    for name, wrong in _wrong_spaces().items():
        with pytest.raises(WrongAnswer):
            exercises.check_search_space(wrong)
            pytest.fail(f"{name} passed")


def _rank_and_next(records, rank):
    seq = max(e["seq"] for e in records[rank]) + 1
    return rank, seq, next(e["op"] for es in records.values() for e in es if e["seq"] == seq)


@pytest.mark.parametrize("wrong", [
    lambda rec: _rank_and_next(rec, min(rec, key=lambda r: len(rec[r]))),  # fewest entries: wrong once buffers wrap
    lambda rec: (max(rec, key=lambda r: rec[r][-1]["seq"]), *solutions.behind(rec)[1:]),  # the rank ahead
    lambda rec: (lambda r, s, o: (r, s - 1, o))(*solutions.behind(rec)),  # its own last collective, not the one missed
    lambda rec: (lambda r, s, o: (r, s, rec[r][-1]["op"]))(*solutions.behind(rec)),  # the op from its own record
    lambda rec: (1, *solutions.behind(rec)[1:]),  # rank 1, as in the notebook's run
    # the last collective any rank recorded: wrong once NCCL's CPUs have queued more behind the one they wait in
    lambda rec: (solutions.behind(rec)[0], max(e["seq"] for es in rec.values() for e in es), "all_reduce"),
    # the lowest last sequence number recorded: wrong once the stuck GPU's CPU has issued as far as the others'
    lambda rec: (lambda last: (min(last, key=last.get), *solutions.behind(rec)[1:]))(
        {r: max((e["seq"] for e in es), default=0) for r, es in rec.items()}),
])
def test_behind_checker(wrong):
    run = exercises.made_records(2, 3, 1, 2)  # the notebook's run: rank 1 stuck before collective #3
    exercises.check_behind(solutions.behind, run, 1)
    with pytest.raises(WrongAnswer):
        exercises.check_behind(wrong, run, 1)
