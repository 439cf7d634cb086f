#!/usr/bin/env python
"""A hyper-parameter search with Ray Tune, as a researcher writes it: no course_utils. Each trial trains
plain_parts.py's model, reports its held-out loss every epoch with a checkpoint, and ASHA stops the trials that
fall behind. Stopped (Ctrl+C, a job's time limit), the same command resumes the search: finished trials are
kept, the others go on from their last checkpoint.

    python scripts/plain_tune.py --num-samples 8 --epochs 4 --storage runs/plain-tune

On a Slurm job's nodes, slurm/*/multi_node_ray.sbatch starts Ray and runs TRAIN_SCRIPT=scripts/plain_tune.py:
ray.init() joins the job's Ray at RAY_ADDRESS (notebook 08, section 4).
"""

import argparse
import os
import tempfile

import ray
import torch
from ray import tune
from ray.tune.schedulers import ASHAScheduler
from torch.utils.data import DataLoader

from plain_parts import build_model, evaluate, get_dataset

parser = argparse.ArgumentParser()
parser.add_argument("--num-samples", type=int, default=8, help="trials drawn from the search space")
parser.add_argument("--epochs", type=int, default=4, help="the most a trial trains (ASHA stops most earlier)")
parser.add_argument("--n-train", type=int, default=4096, help="images of the offline data set")
parser.add_argument("--n-val", type=int, default=1024, help="held-out images of the offline data set")
parser.add_argument("--data", default=None, help="a folder with torchvision's MNIST, instead of the offline data")
parser.add_argument("--cpus-per-trial", type=float, default=1)
parser.add_argument("--gpus-per-trial", type=float, default=0, help="0.5: two trials share a GPU")
parser.add_argument("--storage", default="runs/plain-tune", help="results and checkpoints; the same again resumes")
args = parser.parse_args()


def trial(config: dict) -> None:
    """One trial: its training, resumed from the checkpoint Tune hands back if it was stopped before."""
    device = torch.device("cuda" if ray.get_gpu_ids() else "cpu")  # Ray sets CUDA_VISIBLE_DEVICES to the trial's
    torch.set_num_threads(max(1, int(config["cpus"])))  # the cores Ray counted for it, not all of the node's
    torch.manual_seed(0)
    model = build_model().to(device)
    opt = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=config["momentum"])
    start = 0
    checkpoint = tune.get_checkpoint()  # None for a fresh trial; the last one it reported after a stop or a failure
    if checkpoint:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"), map_location=device)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["epoch"] + 1
    train = DataLoader(get_dataset(config["n_train"], config["data"]), batch_size=config["batch_size"],
                       shuffle=True, generator=torch.Generator().manual_seed(start))
    val = DataLoader(get_dataset(config["n_val"], config["data"], train=False), batch_size=256)
    for epoch in range(start, config["epochs"]):
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x.to(device)), y.to(device))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
        loss_sum, correct, images = evaluate(model, val, device).tolist()
        with tempfile.TemporaryDirectory() as folder:  # Tune copies it into the search's storage
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "epoch": epoch},
                       os.path.join(folder, "state.pt"))
            tune.report({"val_loss": loss_sum / images, "val_acc": correct / images, "epoch": epoch + 1},
                        checkpoint=tune.Checkpoint.from_directory(folder))


# joins a running Ray (RAY_ADDRESS, a Slurm job's) or starts one here; on a node others share, export
# RAY_AUTH_MODE=token first, or anyone who reaches Ray's ports can run code as you (notebook 08)
ray.init()
space = {"lr": tune.loguniform(1e-3, 1e-1), "momentum": tune.choice([0.0, 0.9]), "batch_size": tune.choice([32, 64]),
         "epochs": args.epochs, "n_train": args.n_train, "n_val": args.n_val, "data": args.data,
         "cpus": args.cpus_per_trial}
trainable = tune.with_resources(trial, {"cpu": args.cpus_per_trial, "gpu": args.gpus_per_trial})
storage = os.path.abspath(args.storage)  # Tune wants an absolute path
if tune.Tuner.can_restore(os.path.join(storage, "search")):  # an earlier run of this command: go on with it
    print(f"resuming the search in {args.storage}", flush=True)
    tuner = tune.Tuner.restore(os.path.join(storage, "search"), trainable, resume_errored=True)
else:
    tuner = tune.Tuner(trainable, param_space=space,
                       tune_config=tune.TuneConfig(metric="val_loss", mode="min", num_samples=args.num_samples,
                                                   scheduler=ASHAScheduler(max_t=args.epochs, grace_period=1)),
                       # a trial that fails (a lost node) starts again from its last checkpoint, twice at most
                       run_config=tune.RunConfig(name="search", storage_path=storage,
                                                 failure_config=tune.FailureConfig(max_failures=2)))
results = tuner.fit()
best = results.get_best_result()
trained = sum(r.metrics.get("epoch", 0) for r in results)
print(f"{len(results)} trials, {trained} epochs of the {len(results) * args.epochs} a full search would train; best: "
      f"val_loss {best.metrics['val_loss']:.4f}, val_acc {best.metrics['val_acc']:.1%}, lr {best.config['lr']:.4g}, "
      f"momentum {best.config['momentum']}, batch_size {best.config['batch_size']}", flush=True)
