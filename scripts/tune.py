#!/usr/bin/env python
"""A hyper-parameter or architecture search with Ray Tune, each trial the course's training run.

    python scripts/tune.py --num-samples 16 --epochs 8                  # this machine, ASHA
    python scripts/tune.py --space arch --searcher optuna --num-samples 24
    python scripts/tune.py --workers-per-trial 2                        # each trial is DDP itself
    sbatch slurm/ft3/multi_node_ray.sbatch                              # Ray across a job's nodes

The base settings are the course's flags (every ``scripts/train.py`` flag and ``--config``);
``--epochs`` is the most a trial trains. A search with the same ``--name`` in ``--storage``
is resumed: finished trials are kept, unfinished ones continue from their last epoch
(``--fresh`` starts again). ``RAY_ADDRESS`` or ``--address``: join that Ray cluster (the
Slurm pattern starts one) instead of starting Ray here. The last line is ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from course_utils import tuning
from course_utils.config import add_config_args, config_from_args, job_run_dir, unsupported
from course_utils.errors import fail
from course_utils.results import emit_result


def build_parser() -> argparse.ArgumentParser:
    # in a course Slurm job (slurm/lib/course_job.sh made RUN_DIR): the search in RUN_DIR/tune, every node joined
    run_dir = job_run_dir()
    storage = run_dir / "tune" if run_dir else tuning.DEFAULT_STORAGE
    nodes = int(os.environ.get("SLURM_JOB_NUM_NODES", "1")) if run_dir else 1
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_config_args(p)
    g = p.add_argument_group("search")
    g.add_argument("--space", choices=("hparams", "arch"), default="hparams",
                   help="hparams: lr, batch size, width; arch: depth, width, normalisation, lr (default: hparams)")
    g.add_argument("--num-samples", type=int, default=8, help="trials to run (default: 8)")
    g.add_argument("--scheduler", choices=tuning.SCHEDULERS, default="asha",
                   help="asha stops the worse trials early; fifo trains every trial to --epochs; pbt (Population "
                        "Based Training) copies better trials into worse ones each epoch, perturbing lr (default: asha)")
    g.add_argument("--searcher", choices=tuning.SEARCHERS, default="random",
                   help="random, or optuna (TPE: draws later trials where the good ones were) (default: random)")
    g.add_argument("--grace-epochs", type=int, default=1, help="ASHA's first rung, in epochs (default: 1)")
    g.add_argument("--reduction-factor", type=int, default=2, help="ASHA keeps 1/this at each rung (default: 2)")
    g.add_argument("--cpus-per-trial", type=float, default=1, help="CPUs per trial (per worker) (default: 1)")
    g.add_argument("--gpus-per-trial", type=float, default=0,
                   help="GPUs per trial (per worker); 0.5 packs two trials on a GPU (default: 0)")
    g.add_argument("--workers-per-trial", type=int, default=1, help="DDP workers per trial (default: 1)")
    g.add_argument("--max-concurrent", type=int, default=None, help="at most this many trials at once")
    g.add_argument("--max-failures", type=int, default=0,
                   help="start a failed trial again from its last checkpoint this many times (default: 0)")
    g.add_argument("--name", default="search", help="the search's folder under --storage (default: search)")
    g.add_argument("--storage", default=str(storage),
                   help="where results and checkpoints go; on a cluster, a folder every node sees (default: "
                        "RUN_DIR/tune in a course Slurm job, else runs/tune)")
    g.add_argument("--fresh", action="store_true", help="start the search again instead of resuming it")
    g.add_argument("--address", default=None, help="a running Ray cluster (default: $RAY_ADDRESS, else start one)")
    g.add_argument("--nodes", type=int, default=nodes,
                   help="wait until this many Ray nodes have joined (default: the job's nodes in a course Slurm job, else 1)")
    g.add_argument("--held-out", type=int, default=1000, help="score the best trial on this many unseen images")
    return p


def unfit(args: argparse.Namespace, nodes: list[dict[str, float]]) -> str | None:
    """Why Ray would wait for ever with these nodes: a trial (a DDP trial's worker) no node holds, or a DDP
    trial whose workers do not all fit at once."""
    return tuning.unfit_request(args.cpus_per_trial, args.gpus_per_trial, nodes) or (
        tuning.unfit_ddp_trial(args.workers_per_trial, args.cpus_per_trial, args.gpus_per_trial, nodes)
        if args.workers_per_trial > 1 else None)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        base = config_from_args(args)
        unsupported(base, "tune.py", {"trace_dir"})  # a trial's Trainer records no trace: train.py does
        if args.num_samples < 1 or args.workers_per_trial < 1:
            raise ValueError("--num-samples and --workers-per-trial must be at least 1")
        warning = tuning.gpu_share_warning(args.workers_per_trial, args.gpus_per_trial) or \
            tuning.pbt_refused(args.scheduler, args.searcher, args.workers_per_trial)
        if not (warning or args.address or os.environ.get("RAY_ADDRESS")):
            # the Ray this script would start is this machine: a request it cannot hold is refused before it starts
            warning = unfit(args, [tuning.this_machine()])
        if warning:
            raise ValueError(warning)
    except ValueError as exc:
        return fail(str(exc))
    try:
        resources = tuning.start_ray(args.address, quiet=False)
        nodes = tuning.wait_for_nodes(args.nodes)
        refused = unfit(args, tuning.node_resources())
        if refused:
            raise ValueError(refused)
    except (ConnectionError, TimeoutError, ValueError) as exc:
        return fail(str(exc), code=1)
    print(f"Ray: {len(nodes)} node(s) {', '.join(nodes)}; resources {resources}; "
          f"Ray's temporary files in /tmp on each node ({tuning.ray_temp_dir()} here)", flush=True)
    start = time.perf_counter()
    grid = tuning.run_search(
        base, tuning.space(args.space), name=args.name, num_samples=args.num_samples, scheduler=args.scheduler,
        searcher=args.searcher, storage=args.storage, cpus_per_trial=args.cpus_per_trial,
        gpus_per_trial=args.gpus_per_trial, workers=args.workers_per_trial, grace_epochs=args.grace_epochs,
        reduction_factor=args.reduction_factor, max_concurrent=args.max_concurrent, seed=base.seed,
        max_failures=args.max_failures, fresh=args.fresh,
        verbose=1)
    rows = tuning.trials(grid, base.epochs)
    print(tuning.table(rows), flush=True)
    result = {"script": "tune.py", "nodes": nodes, **tuning.summary(rows), "most_at_once": tuning.most_at_once(grid),
              "seconds": time.perf_counter() - start,
              "path": str(grid.experiment_path), "statuses": [r["status"] for r in rows]}
    left = sum(r["status"] in ("unfinished", "not started") for r in rows) + args.num_samples - len(rows)
    result["stopped"] = left > 0
    if left:  # Tune stopped on a signal (Slurm's warning, Ctrl+C) and saved the search
        again = f"run the same command again (same --storage and --name) and it resumes from {grid.experiment_path}"
        run_dir = job_run_dir()  # a Slurm job's folder (slurm/lib/course_job.sh); a new job gets a new one
        if run_dir and Path(grid.experiment_path).is_relative_to(run_dir.resolve()):
            again = (f"a requeued job resumes it from {grid.experiment_path}, and so does a new job submitted with "
                     f"COURSE_RUN_NAME={Path(run_dir).name} (and the same TRAIN_ARGS)")
        print(f"search stopped with {left} trial(s) left: {again}", flush=True)
    elif args.held_out and result["trials"] > result["errored"]:
        best = grid.get_best_result(metric=tuning.METRIC, mode=tuning.MODE, scope="all")
        result["held_out_loss"], result["held_out_acc"] = tuning.held_out_score(best, args.held_out)
    emit_result(result)
    return 1 if result["errored"] else 0


if __name__ == "__main__":
    sys.exit(main())
