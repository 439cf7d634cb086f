"""A search: its spaces, how many trials fit a node, the schedulers (ASHA, PBT), ``run_search`` (start or
resume one), and the callbacks notebook 08 uses."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import shutil
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..config import TrainConfig
from ..paths import REPO_ROOT
from ..progress import StatusLine
from .trial import ddp_trial, tune_trial

METRIC, MODE = "val_loss", "min"  # what every search ranks its trials by
SEARCHERS = ("random", "optuna")
SCHEDULERS = ("asha", "fifo", "pbt")
DEFAULT_STORAGE = REPO_ROOT / "runs" / "tune"


def space(kind: str) -> dict[str, Any]:
    """The course's search spaces: ``hparams`` (learning rate, batch size, width) or ``arch``
    (depth, width, normalisation, with the learning rate)."""
    from ray import tune

    if kind == "hparams":
        return {"lr": tune.loguniform(1e-3, 0.5), "batch_size": tune.choice([32, 64, 128]),
                "width": tune.choice([16, 32, 64])}
    if kind == "arch":
        return {"depth": tune.randint(2, 6), "width": tune.choice([8, 16, 32, 64]),
                "norm": tune.choice(["batch", "group", "none"]), "lr": tune.loguniform(1e-2, 0.3)}
    raise ValueError(f"unknown search space {kind!r}: hparams or arch")


def gpu_share_warning(workers: int, gpus_per_worker: float) -> str | None:
    """Why a data-parallel trial must not share a GPU between its workers (NCCL), or None."""
    if workers > 1 and 0 < gpus_per_worker < 1:
        return (f"{workers} DDP workers with {gpus_per_worker} GPU each could land on one GPU, and NCCL "
                "cannot run two ranks of a group on one GPU: give each worker a whole GPU (--gpus-per-trial 1)")
    return None


def trials_per_node(cpus: float, gpus: float, trial_cpus: float, trial_gpus: float) -> int:
    """How many trials asking (``trial_cpus``, ``trial_gpus``) Ray fits on a node with ``cpus`` and ``gpus``.

    A fraction of a GPU stays on one GPU: trials of 0.4 GPU fit two per GPU, not 2.5. Counted in Ray's units of
    1/10000 (its resource granularity), as Ray counts: 0.2 GPU fits five per GPU, where float division says four.
    """
    fit = _units(cpus) // _units(trial_cpus) if _units(trial_cpus) else 10**9
    if trial_gpus:
        per_gpu = _units(1) // _units(trial_gpus) if trial_gpus < 1 else 1
        fit = min(fit, int(gpus // max(trial_gpus, 1)) * per_gpu)
    return fit


def _units(amount: float) -> int:
    return round(amount * 10_000)  # ray_constants.MIN_RESOURCE_GRANULARITY = 0.0001


def unfit_request(cpus: float, gpus: float, nodes: Sequence[dict[str, float]]) -> str | None:
    """Why no node of the cluster (each a dict of its ``CPU`` and ``GPU``) can hold one trial (or one DDP
    worker) asking for ``cpus`` and ``gpus``, or None. Ray would not say so: it waits for a node that
    fits for ever (its autoscaler repeating that no node type can hold it), until the job's time limit."""
    if any(trials_per_node(n.get("CPU", 0), n.get("GPU", 0), cpus, gpus) for n in nodes):
        return None
    largest = max(nodes, key=lambda n: (n.get("GPU", 0), n.get("CPU", 0)), default={})
    return (f"a trial asks for {cpus:g} CPUs and {gpus:g} GPUs, and the largest of the {len(nodes)} Ray node(s) "
            f"has {largest.get('CPU', 0):g} CPUs and {largest.get('GPU', 0):g} GPUs, so it would wait for ever: "
            "lower --cpus-per-trial or --gpus-per-trial, or ask Slurm for bigger nodes")


def this_machine() -> dict[str, float]:
    """The CPUs and GPUs of the one Ray node :func:`start_ray` starts here (no address given)."""
    import torch

    from ..hardware import usable_cores

    return {"CPU": usable_cores(), "GPU": torch.cuda.device_count()}


def node_resources() -> list[dict[str, float]]:
    """The CPUs and GPUs of each live node of the running Ray cluster."""
    import ray

    return [{"CPU": n["Resources"].get("CPU", 0), "GPU": n["Resources"].get("GPU", 0)} for n in ray.nodes() if n["Alive"]]


def fitting_trials(workers: int, cpus: float, gpus: float, nodes: Sequence[dict[str, float]]) -> int:
    """How many trials of ``workers`` x (``cpus``, ``gpus``) ``nodes`` (a Ray cluster's) hold at once."""
    return sum(trials_per_node(n.get("CPU", 0), n.get("GPU", 0), cpus, gpus) for n in nodes) // workers


def unfit_ddp_trial(workers: int, cpus: float, gpus: float, nodes: Sequence[dict[str, float]]) -> str | None:
    """Why not even one DDP trial of ``workers`` x (``cpus``, ``gpus``) fits in ``nodes``, or None. Ray Train would
    not say so: without an autoscaler it waits 60 s for its workers, then tries again, for ever."""
    if fitting_trials(workers, cpus, gpus, nodes):
        return None
    have = ", ".join(f"{n.get('CPU', 0):g} CPUs + {n.get('GPU', 0):g} GPUs" for n in nodes)
    return (f"a DDP trial of {workers} workers, each {cpus:g} CPUs and {gpus:g} GPUs, fits nowhere in this Ray "
            f"cluster ({len(nodes)} node(s): {have}): use fewer --workers-per-trial or smaller requests, or ask "
            "Slurm for more nodes")


def pbt_refused(scheduler: str, searcher: str, workers: int) -> str | None:
    """Why a PBT search cannot run this way (one line), or None. PBT changes configurations itself, and a
    DDP trial's Ray Train would start without the checkpoint PBT hands the trial."""
    if scheduler == "pbt" and (searcher != "random" or workers > 1):
        return ("scheduler pbt runs single-process trials drawn at random: use --searcher random and "
                "--workers-per-trial 1, or another scheduler")
    return None


def tpe_startup_trials(num_samples: int) -> int:
    """How many of a TPE search's first trials are drawn at random, before TPE models the finished ones."""
    return max(2, num_samples // 4)


# Tune's lines that say nothing the course's tables do not: the note that a notebook gets the legacy progress
# reporter (before every search) and the warnings of a search interrupted on purpose (notebook 08 restores it),
# "Remote file not found" each time PBT restores a trial (its log files are where they were), "Failed to fetch
# metrics" for trials an interrupted search never started, "Restoring the run", PBT's exploits (trials() lists them)
_QUIET = {"ray.tune.tune": logging.ERROR, "ray.tune.logger.logger": logging.ERROR,
          "ray.tune.analysis.experiment_analysis": logging.ERROR, "ray.tune.execution.tune_controller": logging.WARNING,
          "ray.tune.schedulers.pbt": logging.WARNING, "optuna": logging.WARNING}


class _OneLineErrors(logging.Filter):
    """Tune logs every failed attempt of a trial with its whole traceback (screens of Ray's frames); one line says
    which trial and the error's last line. The whole traceback stays in the trial's folder (error.txt) and in
    ``ResultGrid.errors``."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None:
            text = str(record.exc_info[1]).strip()
            record.msg, record.args = f"{record.getMessage()}: {text.splitlines()[-1] if text else ''}", ()
            record.exc_info = record.exc_text = None
        return True


def _status_reporter(name: str, line: StatusLine) -> Any:
    """A Tune progress reporter that writes one line, ``line(text)``: the trials running, finished and waiting,
    and the best result so far, every 5 s in a notebook (in place) and every minute in a terminal or a batch log
    (a line each). It replaces Tune's own notebook reporter, an HTML table that a saved notebook keeps as an
    empty display."""
    import time

    every_s = 5.0 if line.in_place else 60.0

    from ray.tune import ProgressReporter

    class StatusReporter(ProgressReporter):
        def __init__(self) -> None:
            self.last = 0.0

        def should_report(self, trials: list[Any], done: bool = False) -> bool:
            now = time.monotonic()
            if done or now - self.last < every_s:
                return False
            self.last = now
            return True

        def report(self, trials: list[Any], done: bool, *sys_info: str) -> None:
            states = [t.status for t in trials]
            scores = [t.last_result.get(METRIC) for t in trials if t.last_result]
            scores = [x for x in scores if isinstance(x, (int, float))]
            best = f"; best {METRIC} {min(scores) if MODE == 'min' else max(scores):.4f}" if scores else ""
            line(f"search {name}: {states.count('RUNNING')} trial(s) running, {states.count('TERMINATED')} "
                 f"finished, {states.count('PENDING')} waiting{best}")

    return StatusReporter()


@contextlib.contextmanager
def _quiet_tune():
    """:data:`_QUIET`'s loggers held at their levels for the search, and put back as they were afterwards."""
    loggers = {logging.getLogger(name): level for name, level in _QUIET.items()}
    before = {log: log.level for log in loggers}
    for log, level in loggers.items():
        log.setLevel(level)
    one_line = _OneLineErrors()
    controller = logging.getLogger("ray.tune.execution.tune_controller")
    controller.addFilter(one_line)
    try:
        yield
    finally:
        controller.removeFilter(one_line)
        for log, level in before.items():
            log.setLevel(level)


def run_search(base: TrainConfig, param_space: dict[str, Any], *, name: str, num_samples: int,
               scheduler: str = "asha", searcher: str = "random", storage: str | Path = DEFAULT_STORAGE,
               cpus_per_trial: float = 1, gpus_per_trial: float = 0, workers: int = 1, grace_epochs: int = 1,
               reduction_factor: int = 2, max_concurrent: int | None = None, seed: int = 0,
               max_failures: int = 0, fresh: bool = False, callbacks: Sequence[Any] = (), verbose: int = 0) -> Any:
    """Run (or resume) the search ``name``: ``num_samples`` trials of ``param_space`` on top of ``base``,
    each at most ``base.epochs`` epochs; returns Tune's ``ResultGrid``.

    ``scheduler``: ``asha`` stops the worse trials at each rung (``grace_epochs``, then times
    ``reduction_factor``), ``fifo`` runs every trial to the end, ``pbt`` (Population Based
    Training) replaces a trial in the worst quarter after each epoch by a copy of one in the best
    quarter, its weights and its lr changed (x0.8 or x1.2, or drawn anew from the space's ``lr``).
    ``max_failures``: how often a trial that fails is started again from its last checkpoint
    before Tune records it as errored (the search goes on either way). ``searcher``: ``random``, or
    ``optuna`` (TPE: later trials are drawn where the good ones were). ``workers > 1``: each trial
    trains with that many DDP workers. A search found in ``storage`` is resumed (finished trials are
    kept, unfinished ones continue from their last epoch) unless ``fresh``.
    """
    from ray import tune
    from ray.tune.search.basic_variant import BasicVariantGenerator

    if scheduler not in SCHEDULERS or searcher not in SEARCHERS:
        raise ValueError(f"scheduler: {' or '.join(SCHEDULERS)}; searcher: {' or '.join(SEARCHERS)}")
    warning = gpu_share_warning(workers, gpus_per_trial)
    if warning:
        raise ValueError(warning)
    refused = pbt_refused(scheduler, searcher, workers)
    if refused:
        raise ValueError(refused)
    storage = Path(storage).resolve()  # Ray wants an absolute path; on a cluster, one every node sees
    path = storage / name
    if workers > 1:
        # the trial itself only drives Ray Train, its workers ask for the CPUs and GPUs; Ray wants a
        # trial to ask for something, so it asks for 64 MiB of memory and no CPU
        trainable = tune.with_resources(ddp_trial, {"cpu": 0, "memory": 64 << 20})
        param_space = {**param_space, "workers": workers, "cpus_per_worker": cpus_per_trial,
                       "gpus_per_worker": gpus_per_trial, "storage": str(storage / f"{name}-workers")}
        nodes = node_resources()
        unfit = unfit_ddp_trial(workers, cpus_per_trial, gpus_per_trial, nodes)
        if unfit:
            raise ValueError(unfit)
        if max_concurrent is None:  # else every trial's Ray Train waits for workers the others hold, and times out
            max_concurrent = fitting_trials(workers, cpus_per_trial, gpus_per_trial, nodes)
    else:
        trainable = tune.with_resources(tune_trial, {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(storage / f"{name}-workers", ignore_errors=True)
    elif tune.Tuner.can_restore(path):
        with _quiet_tune():
            tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True, resume_errored=True)
            return tuner.fit()
    if scheduler == "pbt":
        random.seed(seed)  # PBT draws its donors and perturbations from Python's random module
    sched = make_scheduler(scheduler, base.epochs, param_space, grace_epochs, reduction_factor)
    if searcher == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        # TPE models the good and the bad trials once a few random ones have finished
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=tpe_startup_trials(num_samples))
        search_alg = OptunaSearch(sampler=sampler)
    else:
        # the same draws for the same seed; it limits concurrency itself (TuneConfig's limit is for searchers)
        search_alg = BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent or 0)
        max_concurrent = None
    status = StatusLine()  # the search's progress, one line (cleared at its end)
    tuner = tune.Tuner(
        trainable,
        param_space={**param_space, "base": asdict(base)},
        tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, num_samples=num_samples, scheduler=sched,
                                    search_alg=search_alg, max_concurrent_trials=max_concurrent,
                                    reuse_actors=workers == 1),  # a DDP trial's Ray Train is started afresh
        run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=verbose,
                                  progress_reporter=_status_reporter(name, status),  # the course's status line
                                  callbacks=[*callbacks, _count_running(path)],  # + counts trials at once (section 2)
                                  failure_config=tune.FailureConfig(max_failures=max_failures),
                                  # the best epoch's checkpoint (scored by held_out_score) and the latest (resumed);
                                  # PBT keeps all: a trial that exploits another loads the checkpoint the donor
                                  # had then, which the donor's later epochs would otherwise have deleted
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=None if scheduler == "pbt" else 1,
                                                                          checkpoint_score_attribute=METRIC,
                                                                          checkpoint_score_order=MODE)),
    )
    with _quiet_tune(), status:  # Tune's own log lines off the page: the status line says where the search is
        return tuner.fit()


def make_scheduler(scheduler: str, max_epochs: int, param_space: dict[str, Any], grace_epochs: int = 1,
                   reduction_factor: int = 2) -> Any:
    """The Tune scheduler :func:`run_search` gives a search (``asha``, ``fifo`` or ``pbt``; see there),
    for trials of at most ``max_epochs`` epochs; notebook 08 prints its settings from it."""
    from ray.tune.schedulers import ASHAScheduler, FIFOScheduler

    if scheduler == "asha":
        return ASHAScheduler(time_attr="training_iteration", max_t=max_epochs, grace_period=grace_epochs,
                             reduction_factor=reduction_factor)
    if scheduler == "pbt":
        from ray.tune.schedulers import PopulationBasedTraining

        if not hasattr(param_space.get("lr"), "sample"):
            raise ValueError("scheduler pbt mutates the learning rate: give the space an lr range (tune.loguniform)")
        return PopulationBasedTraining(time_attr="training_iteration", perturbation_interval=1,
                                       hyperparam_mutations={"lr": param_space["lr"]})
    if scheduler == "fifo":
        return FIFOScheduler()
    raise ValueError(f"scheduler: {' or '.join(SCHEDULERS)}, not {scheduler!r}")


PEAK_FILE = "most_at_once.json"  # beside the search's state: the most trials Tune had running at once


def _count_running(folder: Path) -> Any:
    """A Tune callback that counts the trials Tune holds RUNNING (each holding the CPUs and GPUs Ray
    granted it) at every step of its loop, and keeps the peak in ``folder``/PEAK_FILE whenever it rises.
    Tune's own accounting: a trial's first and last report would miss the time it holds its resources
    before its first epoch ends and after its last (short trials overlap more than their reports show)."""
    import json

    from ray import tune

    class CountRunning(tune.Callback):  # defined here: importing tuning does not import Ray
        def __init__(self) -> None:
            self.peak = 0

        def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
            running = sum(t.status == "RUNNING" for t in trials)
            if running > self.peak:
                self.peak = running
                folder.mkdir(parents=True, exist_ok=True)
                file = folder / PEAK_FILE
                before = json.loads(file.read_text())["most_at_once"] if file.exists() else 0
                file.write_text(json.dumps({"most_at_once": max(before, running)}))

    return CountRunning()


def most_at_once(grid: Any) -> int:
    """The most trials the search ``grid`` had running at the same moment (Tune's count, over every run of it)."""
    import json

    file = Path(grid.experiment_path) / PEAK_FILE
    return json.loads(file.read_text())["most_at_once"] if file.exists() else 0


def interrupt_after(finished: int) -> Any:
    """A Tune callback that presses Ctrl+C once ``finished`` trials have finished and another trial is
    part-way (it has reported an epoch, not its last): the search stops as it would on a job's time
    limit or a stop button, with work of both kinds to resume, and saves its state for ``Tuner.restore``.
    A restored search carries the callback along (Tune saves it with the run); it does nothing there,
    where that many trials had finished before it started."""
    import signal

    from ray import tune

    def done(trials: list) -> int:
        return sum(t.status == "TERMINATED" for t in trials)

    class InterruptAfter(tune.Callback):  # defined here: importing tuning does not import Ray
        def __init__(self) -> None:
            self.before: int | None = None  # trials finished when this run started
            self.fired = False

        def on_step_begin(self, iteration: int, trials: list, **info: Any) -> None:
            if self.before is None:
                self.before = done(trials)

        # after Tune has registered a part-way trial's checkpoint, not on its result (on_trial_result comes
        # first: a stop there leaves the trial with no checkpoint to continue from, and it starts over)
        def on_checkpoint(self, iteration: int, trials: list, trial: Any, checkpoint: Any, **info: Any) -> None:
            last = trial.last_result.get("training_iteration", 0) >= trial.config["base"]["epochs"]
            if not self.fired and not last and (self.before or 0) < finished <= done(trials):
                self.fired = True
                os.kill(os.getpid(), signal.SIGINT)  # Tune's own handler: stop and save the state

    return InterruptAfter()


