"""What a search found: each trial's row (status, epochs, losses, lr per epoch), PBT's exploits, tables,
and the best trial scored on held-out images."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .search import METRIC, MODE
from .trial import RUN_KEYS, trial_settings


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
                         "status": status(trial.status, 0, max_epochs), "hosts": [], "gpus_seen": [],
                         "reported": [], "lr": [], "at_epoch": [], "starts": 0, "checkpoint_epoch": None,
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
            "gpus_seen": sorted({str(g) for g in frame["gpus_seen"]}) if "gpus_seen" in frame else [],
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
    from ..checkpoint import load_checkpoint

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
            "best_config": best.get("config"), "hosts": sorted({h for r in rows for h in r["hosts"]}),
            "gpus_seen": sorted({g for r in rows for g in r.get("gpus_seen", [])})}


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
    from ..checkpoint import load_checkpoint
    from ..data import INFO, held_out_set, make_loader
    from ..models import build_model
    from ..trainer import evaluate

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
