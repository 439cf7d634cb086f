"""Ray Tune around the course's Trainer: notebook 08, ``scripts/tune.py`` and ``slurm/*/multi_node_ray.sbatch``.

A trial is the course's own training run (:func:`train_one`: the data, model and
:class:`~course_utils.trainer.Trainer` of ``scripts/train.py``). The Trainer's epoch
callback reports to Tune after each epoch, with the checkpoint it has just written, so
ASHA can stop a trial between two epochs and a resumed search continues a trial from its
last epoch. A trial with ``workers > 1`` is itself data parallel: Ray Train's
``TorchTrainer`` starts the workers and their process group, and the same Trainer wraps
the model in DDP because it finds a process group (:func:`ddp_trial`).

Ray itself: :func:`start_ray` joins the cluster named by ``RAY_ADDRESS`` (the Slurm
pattern starts one across the job's nodes) or starts one on this machine, with its
temporary files in a short folder under /tmp (not the shared home: Ray's sockets live
there, and a socket's path may be at most 107 bytes) and token authentication on.
"""

from __future__ import annotations

import getpass
import logging
import math
import os
import random
import secrets
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, fields, replace
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig
from .paths import REPO_ROOT

METRIC, MODE = "val_loss", "min"  # what every search ranks its trials by
SHAPE_KEYS = ("width", "depth", "norm")  # the architecture knobs of the CNN (models.build_model)
# what run_search adds to a trial's settings: the base TrainConfig, how a DDP trial is laid out, and
# fail_at_epoch: the trial raises after that epoch (a transient failure: not once restored from a checkpoint;
# with fail_every_start, every time: a bug), for notebook 08's lesson on FailureConfig
RUN_KEYS = ("base", "workers", "cpus_per_worker", "gpus_per_worker", "storage", "fail_at_epoch", "fail_every_start")
SEARCHERS = ("random", "optuna")
SCHEDULERS = ("asha", "fifo", "pbt")
DEFAULT_STORAGE = REPO_ROOT / "runs" / "tune"


# --------------------------------------------------------------------------- #
# Ray itself
# --------------------------------------------------------------------------- #
def ray_temp_dir() -> str:
    """A short, node-local folder for Ray's sessions, sockets and logs: per job under Slurm, else per user."""
    job = os.environ.get("SLURM_JOB_ID")  # slurm/lib/ray_node.sh names it the same way
    return f"/tmp/ray-{job}-{socket.gethostname().split('.')[0]}" if job else f"/tmp/ray-{getpass.getuser()}"


def auth_env() -> dict[str, str]:
    """Token authentication with a fresh token, unless ``RAY_AUTH_MODE`` is already set.

    Ray's processes listen on the node's network: on a shared node (a login node, a
    JupyterLab job on a node other jobs share) anyone who reaches the port could run code
    as you. The token lives in the environment of this process and its children only,
    not in a file in your home folder.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


def start_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
              quiet: bool = True) -> dict[str, float]:
    """Join the Ray cluster at ``address`` (or ``$RAY_ADDRESS``), or start one here; its resources.

    ``quiet``: the trials' own output stays in their log files, not in this cell or terminal.
    """
    import sys

    from .hardware import usable_cores

    # Tune snapshots its state whenever a trial replaces its one kept checkpoint; cheap here, so no warning
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    imported = "ray" in sys.modules
    token = auth_env()
    os.environ.update(token)  # the processes Ray starts inherit it
    import ray

    if imported and token:  # Ray read the mode when it was imported: have it read it again, as Ray itself does
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            why = unreachable(address)
            if why:
                raise ConnectionError(why)
            ray.init(address=address, log_to_driver=not quiet)
        else:
            ray.init(num_cpus=num_cpus or usable_cores(), num_gpus=num_gpus, include_dashboard=False,
                     _temp_dir=ray_temp_dir(), log_to_driver=not quiet)
    return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why no Ray can be listening at ``address`` (HOST:PORT), or None. Checked in seconds: ``ray.init``
    itself retries a silent address for minutes before it gives up with a stack of tracebacks."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None  # "auto", ray://...: Ray's own forms, left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return (f"no Ray is listening at {address} ({exc.strerror or exc}): start one there (ray start --head "
                f"--port {port}), or leave out --address and RAY_ADDRESS to start Ray on this machine")
    return None


def wait_for_nodes(count: int, timeout_s: float = 120.0) -> list[str]:
    """Wait until ``count`` nodes have joined the cluster; their addresses. Names the missing ones on timeout."""
    import ray

    from .waiting import wait_until

    def alive() -> list[str]:
        return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])

    wait_until(lambda: len(alive()) >= count, timeout_s, interval_s=1.0, on_timeout=lambda: TimeoutError(
        f"only {len(alive())} of {count} Ray nodes joined within {timeout_s:.0f} s "
        f"({', '.join(alive()) or 'none'}): see the workers' lines in the job log"))
    return alive()


# --------------------------------------------------------------------------- #
# One trial: the course's training run, reporting each epoch
# --------------------------------------------------------------------------- #
Report = Callable[[dict[str, Any], str], None]  # (metrics, folder holding the checkpoint)


def trial_settings(params: dict[str, Any]) -> tuple[TrainConfig, dict[str, Any]]:
    """A trial's :class:`TrainConfig` (the base settings, then the sampled ones) and the CNN's shape."""
    names = {f.name for f in fields(TrainConfig)}
    unknown = set(params) - names - set(SHAPE_KEYS) - set(RUN_KEYS)
    if unknown:
        raise ValueError(f"a search space sets TrainConfig fields or {', '.join(SHAPE_KEYS)}, "
                         f"not {', '.join(sorted(unknown))}")
    cfg = TrainConfig(**{**params.get("base", {}), **{k: v for k, v in params.items() if k in names}})
    return cfg, {k: params[k] for k in SHAPE_KEYS if k in params}


def train_one(params: dict[str, Any], device: torch.device, workdir: str, report: Report) -> None:
    """Train the configuration ``params`` with the course's Trainer, resuming from ``workdir/last.pt``
    if a checkpoint was restored there, and ``report`` after every epoch."""
    from .process_group import ranks_agree
    from .trainer import build_trainer

    cfg, shape = trial_settings(params)
    cfg = replace(cfg, ckpt_dir=workdir, resume=True, log_dir=None, progress=False)
    trainer = build_trainer(cfg, device, **shape)  # the same set-up as scripts/train.py
    started, host = time.time(), socket.gethostname()
    fresh = trainer.epoch == 0  # not restored from a checkpoint (a resumed search, a retry, PBT's exploit)

    def epoch_done(stats: Any) -> None:
        if trainer.epoch == params.get("fail_at_epoch") and (fresh or params.get("fail_every_start")):
            raise RuntimeError(f"this trial fails on purpose after epoch {trainer.epoch} (fail_at_epoch), "
                               "before reporting it")
        report({"epoch": trainer.epoch, "train_loss": stats.train_loss, "val_loss": stats.val_loss,
                "val_acc": stats.val_acc, "images_per_s": stats.images_per_s, "host": host,
                "lr": trainer.optimizer.param_groups[0]["lr"],  # the one the optimiser used (PBT changes it)
                # a DDP trial's proof: identical replicas (a collective: every worker reports at this point;
                # True without a process group), and each worker's share of the images, not all of them
                "ranks_agree": ranks_agree(trainer.model), "batches": len(trainer.train_loader),
                "device": str(device), "started": started, "now": time.time()}, workdir)

    trainer.epoch_callback = epoch_done
    trainer.fit()


def _use_assigned_cores() -> None:
    """Threads from the CPUs Ray gave this trial, not the node's."""
    import ray

    from .hardware import usable_cores

    cpus = ray.get_runtime_context().get_assigned_resources().get("CPU", 1)
    torch.set_num_threads(max(1, min(int(cpus), usable_cores())))  # never more than the process may use


def _copy_restored(checkpoint: Any, work: str) -> None:
    """Put a restored trial's checkpoint (a resumed search, or a trial restarted after a failure)
    where the Trainer resumes from; nothing for a trial starting afresh."""
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            shutil.copytree(folder, work, dirs_exist_ok=True)


def tune_trial(params: dict[str, Any]) -> None:
    """A Ray Tune function trainable: one process, on the GPU Ray assigned it (if any) or the CPU."""
    from ray import tune

    from .process_group import choose_device

    _use_assigned_cores()
    with tempfile.TemporaryDirectory(prefix="trial-") as work:
        _copy_restored(tune.get_checkpoint(), work)

        def report(metrics: dict[str, Any], folder: str) -> None:
            tune.report(metrics, checkpoint=tune.Checkpoint.from_directory(folder))

        # Ray sets CUDA_VISIBLE_DEVICES to the trial's GPUs (none: the CPU).
        train_one(params, choose_device("auto"), work, report)


def _ddp_worker(params: dict[str, Any]) -> None:
    """One worker of a data-parallel trial: Ray Train has set up its process group (gloo or NCCL)."""
    import ray.train
    import ray.train.torch

    _use_assigned_cores()
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory(prefix="ddp-trial-") as work:
        _copy_restored(ray.train.get_checkpoint(), work)

        def report(metrics: dict[str, Any], folder: str) -> None:
            # every worker reports; rank 0 wrote the checkpoint and hands it over
            checkpoint = ray.train.Checkpoint.from_directory(folder) if rank == 0 else None
            ray.train.report({**metrics, "workers": ray.train.get_context().get_world_size()}, checkpoint=checkpoint)

        train_one(params, ray.train.torch.get_device(), work, report)


def ddp_trial(params: dict[str, Any]) -> None:
    """A trial that is itself distributed: ``params["workers"]`` DDP workers started by Ray Train's
    ``TorchTrainer``, whose epochs reach Tune (and ASHA) through ``TuneReportCallback``."""
    import ray.train
    from ray import tune
    from ray.train.torch import TorchTrainer
    from ray.tune.integration.ray_train import TuneReportCallback

    gpus = float(params.get("gpus_per_worker", 0))
    trainer = TorchTrainer(
        _ddp_worker,
        train_loop_config=params,
        scaling_config=ray.train.ScalingConfig(num_workers=int(params["workers"]), use_gpu=gpus > 0,
                                               resources_per_worker={"CPU": params.get("cpus_per_worker", 1),
                                                                     **({"GPU": gpus} if gpus else {})}),
        run_config=ray.train.RunConfig(name=tune.get_context().get_trial_id(), storage_path=params["storage"],
                                       callbacks=[TuneReportCallback()]),
    )
    trainer.fit()


# --------------------------------------------------------------------------- #
# A search
# --------------------------------------------------------------------------- #
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

    A fraction of a GPU stays on one GPU: trials of 0.4 GPU fit two per GPU, not 2.5.
    """
    fit = int(cpus // trial_cpus) if trial_cpus else 10**9
    if trial_gpus:
        per_gpu = int(1 // trial_gpus) if trial_gpus < 1 else 1
        fit = min(fit, int(gpus // max(trial_gpus, 1)) * per_gpu)
    return fit


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

    from .hardware import usable_cores

    return {"CPU": usable_cores(), "GPU": torch.cuda.device_count()}


def node_resources() -> list[dict[str, float]]:
    """The CPUs and GPUs of each live node of the running Ray cluster."""
    import ray

    return [{"CPU": n["Resources"].get("CPU", 0), "GPU": n["Resources"].get("GPU", 0)} for n in ray.nodes() if n["Alive"]]


def fitting_trials(workers: int, cpus: float, gpus: float) -> int:
    """How many trials of ``workers`` x (``cpus``, ``gpus``) the running Ray cluster holds at once, node by node."""
    return sum(trials_per_node(n["CPU"], n["GPU"], cpus, gpus) for n in node_resources()) // workers


def pbt_refused(scheduler: str, searcher: str, workers: int) -> str | None:
    """Why a PBT search cannot run this way (one line), or None. PBT changes configurations itself, and a
    DDP trial's Ray Train would start without the checkpoint PBT hands the trial."""
    if scheduler == "pbt" and (searcher != "random" or workers > 1):
        return ("scheduler pbt runs single-process trials drawn at random: use --searcher random and "
                "--workers-per-trial 1, or another scheduler")
    return None


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
        if max_concurrent is None:  # else every trial's Ray Train waits for workers the others hold, and times out
            max_concurrent = max(1, fitting_trials(workers, cpus_per_trial, gpus_per_trial))
    else:
        trainable = tune.with_resources(tune_trial, {"cpu": cpus_per_trial, "gpu": gpus_per_trial})
    if fresh:
        shutil.rmtree(path, ignore_errors=True)
        shutil.rmtree(storage / f"{name}-workers", ignore_errors=True)
    elif tune.Tuner.can_restore(path):
        tuner = tune.Tuner.restore(str(path), trainable=trainable, resume_unfinished=True, resume_errored=True)
        return tuner.fit()
    if scheduler == "pbt":
        random.seed(seed)  # PBT draws its donors and perturbations from Python's random module
    sched = make_scheduler(scheduler, base.epochs, param_space, grace_epochs, reduction_factor)
    if searcher == "optuna":
        import optuna
        from ray.tune.search.optuna import OptunaSearch

        # TPE models the good and the bad trials once a few random ones have finished
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=max(2, num_samples // 4))
        search_alg = OptunaSearch(sampler=sampler)
    else:
        # the same draws for the same seed; it limits concurrency itself (TuneConfig's limit is for searchers)
        search_alg = BasicVariantGenerator(random_state=seed, max_concurrent=max_concurrent or 0)
        max_concurrent = None
    tuner = tune.Tuner(
        trainable,
        param_space={**param_space, "base": asdict(base)},
        tune_config=tune.TuneConfig(metric=METRIC, mode=MODE, num_samples=num_samples, scheduler=sched,
                                    search_alg=search_alg, max_concurrent_trials=max_concurrent,
                                    reuse_actors=workers == 1),  # a DDP trial's Ray Train is started afresh
        run_config=tune.RunConfig(name=name, storage_path=str(storage), verbose=verbose,
                                  callbacks=[*callbacks, _count_running(path)],
                                  failure_config=tune.FailureConfig(max_failures=max_failures),
                                  # the best epoch's checkpoint (scored by held_out_score) and the latest (resumed);
                                  # PBT keeps all: a trial that exploits another loads the checkpoint the donor
                                  # had then, which the donor's later epochs would otherwise have deleted
                                  checkpoint_config=tune.CheckpointConfig(num_to_keep=None if scheduler == "pbt" else 1,
                                                                          checkpoint_score_attribute=METRIC,
                                                                          checkpoint_score_order=MODE)),
    )
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


# --------------------------------------------------------------------------- #
# What a search found
# --------------------------------------------------------------------------- #
def trials(grid: Any, max_epochs: int) -> list[dict[str, Any]]:
    """One row per trial: its sampled settings, epochs trained, curves, where it ran and how it ended."""
    from ray.tune import ExperimentAnalysis

    # Tune's own record of each trial (TERMINATED, ERROR, RUNNING, ...), as saved in the search's folder
    quiet = logging.getLogger("ray.tune.analysis.experiment_analysis")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its "no metrics" warning for trials not started: they have none
    try:
        tune_trials = {Path(t.path).name: t for t in ExperimentAnalysis(grid.experiment_path).trials}
    finally:
        quiet.setLevel(level)
    rows = []
    for result in grid:
        frame = history(result)
        config = {k: v for k, v in (result.config or {}).items() if k not in RUN_KEYS}
        trial = tune_trials[Path(result.path).name]
        if frame is None or frame.empty:
            rows.append({"trial": trial.trial_id, "config": config, "epochs": 0,
                         "val_loss": [], "val_acc": [], "best_val_loss": math.nan, "best_val_acc": math.nan,
                         "status": status(trial.status, 0, max_epochs), "hosts": [], "reported": [], "lr": [], "at_epoch": [], "starts": 0, "checkpoint_epoch": None,
                         "failures": trial.num_failures,
                         "tag": trial.experiment_tag, "start": math.nan, "end": math.nan})
            continue
        epochs = int(frame["training_iteration"].max())
        rows.append({
            "trial": trial.trial_id,
            "config": config,
            "epochs": epochs,
            "val_loss": frame["val_loss"].tolist(),
            "val_acc": frame["val_acc"].tolist(),
            "best_val_loss": float(frame["val_loss"].min()),
            "best_val_acc": float(frame["val_acc"].max()),
            "status": status(trial.status, epochs, max_epochs),
            "hosts": sorted(set(frame["host"])),
            "reported": frame["now"].tolist(),  # when each epoch was reported
            "lr": frame["lr"].tolist() if "lr" in frame else [],  # the optimiser's, per epoch
            "at_epoch": frame["epoch"].tolist(),  # the Trainer's epoch of each report (PBT's copies jump)
            "failures": trial.num_failures,  # Tune's count: retried (FailureConfig) or errored
            # processes the trial ran in: 1, or more after a retry (FailureConfig) or a PBT exploit
            "starts": int(frame["started"].nunique()),
            "checkpoint_epoch": _checkpoint_epoch(result),
            "tag": trial.experiment_tag,
            "workers": int(frame["workers"].iloc[-1]) if "workers" in frame else 1,
            "start": float(frame["started"].iloc[0]),
            "end": float(frame["now"].iloc[-1]),
        })
    return sorted(rows, key=lambda r: (math.isnan(r["best_val_loss"]), r["best_val_loss"]))


def history(result: Any) -> Any:
    """Every report of a trial, in order, as a DataFrame (empty when it reported nothing).

    Ray keeps two logs of them in the trial's folder, ``result.json`` (what ``Result.metrics_dataframe``
    reads) and ``progress.csv``. Ray 2.60's JSON logger reopens its file each time a trial starts again
    (a pause of Population Based Training, a retry) and first copies the storage's copy over it, which
    may be older: reports are lost (seen in notebook 08: a PBT trial with 1 of its 4 epochs). The CSV
    logger keeps its file open until the trial ends. So: the longer of the two."""
    import pandas as pd

    folder = Path(result.path)
    frames = [result.metrics_dataframe if result.metrics_dataframe is not None else pd.DataFrame()]
    if (folder / "progress.csv").is_file() and (folder / "progress.csv").stat().st_size:
        frames.append(pd.read_csv(folder / "progress.csv", dtype={"trial_id": str}))
    return max(frames, key=len)


def _checkpoint_epoch(result: Any) -> int | None:
    """Epochs done in the last checkpoint Tune registered for the trial (where a restored search continues
    it), or None: a DDP trial's checkpoints are Ray Train's, and a trial may have none yet."""
    from .checkpoint import load_checkpoint

    if result.checkpoint is None:
        return None
    with result.checkpoint.as_directory() as folder:
        path = Path(folder) / "last.pt"
        return load_checkpoint(path)["epoch"] if path.exists() else None


def exploits(grid: Any) -> list[dict[str, Any]]:
    """What Population Based Training did, in order (Tune's ``pbt_global.txt``): at which epoch which
    trial (its tag, as in ``trials``' rows) took the weights of which, and the lr it went on with."""
    import json

    file = Path(grid.experiment_path) / "pbt_global.txt"
    lines = file.read_text().splitlines() if file.exists() else []
    rows = []
    for target, donor, epoch, donor_epoch, donor_config, new_config in map(json.loads, lines):
        rows.append({"trial": target, "donor": donor, "epoch": epoch, "donor_epoch": donor_epoch,
                     "donor_lr": donor_config["lr"], "lr": new_config["lr"]})
    return rows


def best_so_far(rows: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """The search as a budget: after each trial (in the order they started), the epochs spent so far and
    the best validation loss found so far."""
    spent, best, xs, ys = 0, math.inf, [], []
    for row in sorted(rows, key=lambda r: r["start"]):
        spent, best = spent + row["epochs"], min(best, row["best_val_loss"])
        xs.append(spent)
        ys.append(best)
    return xs, ys


def status(state: str, epochs: int, max_epochs: int) -> str:
    """How a trial ended, from Tune's ``state`` of it. A trial whose last report arrived just before
    the search was stopped is not TERMINATED: a restored search runs it on from its last checkpoint."""
    if state == "ERROR":
        return "errored"
    if state != "TERMINATED":
        return "unfinished" if epochs else "not started"
    return "completed" if epochs >= max_epochs else "stopped early"


def summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The search in numbers: trials, how many were stopped early, epochs spent, the best trial."""
    best = rows[0] if rows else {}
    return {"trials": len(rows), "stopped_early": sum(r["status"] == "stopped early" for r in rows),
            "errored": sum(r["status"] == "errored" for r in rows), "epochs": sum(r["epochs"] for r in rows),
            "best_val_loss": best.get("best_val_loss"), "best_val_acc": best.get("best_val_acc"),
            "best_config": best.get("config"), "hosts": sorted({h for r in rows for h in r["hosts"]})}


def table(rows: list[dict[str, Any]], keys: Sequence[str] | None = None) -> str:
    """The trials as a plain-text table, best first."""
    keys = list(keys or (rows[0]["config"] if rows else []))

    def fmt(v: Any) -> str:
        return f"{v:.4g}" if isinstance(v, float) else str(v)

    head = [*keys, "epochs", "best val_loss", "best val_acc", "status"]
    body = [[fmt(r["config"].get(k, "")) for k in keys]
            + [str(r["epochs"]), f"{r['best_val_loss']:.4f}", f"{r['best_val_acc']:.3f}", r["status"]] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths)) for b in body]
    return "\n".join(lines)


def held_out_score(result: Any, n: int = 1000) -> tuple[float, float]:
    """Loss and accuracy, on images no trial trained or was ranked on, of the checkpoint of the trial's epoch
    that ranked it (``get_best_result(..., scope="all")`` ranks a trial by its best epoch, not its last)."""
    from .checkpoint import load_checkpoint
    from .data import INFO, held_out_set, make_loader
    from .models import build_model
    from .trainer import evaluate

    cfg, shape = trial_settings(result.config)
    data = held_out_set(cfg.dataset, cfg.data_root, n, n_train=cfg.n_train, n_val=cfg.n_val, seed=cfg.seed)
    model = build_model(cfg.model, INFO[cfg.dataset].channels, INFO[cfg.dataset].num_classes, **shape)
    if result.checkpoint is not None:  # the epoch that won (kept beside the latest: run_search's CheckpointConfig)
        with (result.get_best_checkpoint(METRIC, MODE) or result.checkpoint).as_directory() as folder:
            state = load_checkpoint(Path(folder) / "last.pt")
    else:  # a DDP trial: Ray Train kept every epoch's checkpoint, and Tune got each one's path
        frame = history(result)
        won = frame[METRIC].idxmin() if MODE == "min" else frame[METRIC].idxmax()
        state = load_checkpoint(Path(frame.loc[won, "checkpoint_path"]) / "last.pt")
    model.load_state_dict(state["model"])
    return evaluate(model, make_loader(data, 256, shuffle=False), torch.device("cpu"))
