"""Notebooks 06-08: gradient accumulation in a Fabric loop, a DeepSpeed configuration for a memory budget, trials at once,
a search space with notebook 03's scaling rule."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import first_line
from .core import ExerciseNotDone, WrongAnswer, passed


# --------------------------------------------------------------------------- #
# 06: gradient accumulation in a Fabric loop, run on two ranks forked from the kernel
# --------------------------------------------------------------------------- #
FABRIC_CASES = ((1000, 32, 4), (600, 16, 5), (256, 16, 1))  # (images, batch per rank, accumulate): not run in §2


def fabric_accounts(epoch: Callable[..., int], layouts: Sequence[tuple[int, int, int]]) -> list[dict[str, Any]]:
    """``epoch(fabric, model, optimizer, loader, accumulate)`` run once per layout (images, batch per rank,
    accumulate) on 2 CPU ranks forked from this process, by Fabric: rank 0's account of each run (the steps it
    returned, the optimiser steps taken, the gradient all-reduces, the batches, whether the ranks' weights agree)."""
    import lightning as L
    import torch
    from lightning.fabric.plugins.environments import LightningEnvironment
    from torch import nn
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.utils.data import DataLoader, TensorDataset

    from ..launch import environment_kept
    from ..lit import quiet_lightning

    def run(fabric: L.Fabric) -> list[dict[str, Any]]:
        torch.set_num_threads(1)  # forked from a process that computed with several threads: one each
        accounts = []
        for n, batch, accumulate in layouts:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
            g = torch.Generator().manual_seed(1)
            data = TensorDataset(torch.randn(n, 8, generator=g), torch.randint(0, 4, (n,), generator=g))
            model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            loader = fabric.setup_dataloaders(DataLoader(data, batch_size=batch, shuffle=True, drop_last=True))
            taken, syncs = [], []
            optimizer.optimizer.register_step_post_hook(lambda *_: taken.append(1))

            def counted(state, bucket):  # DDP's own all-reduce of a gradient bucket, counted
                syncs.append(1)
                return allreduce_hook(state, bucket)

            model._forward_module.register_comm_hook(None, counted)
            returned = epoch(fabric, model, optimizer, loader, accumulate)
            flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            every = [torch.empty_like(flat) for _ in range(2)]
            torch.distributed.all_gather(every, flat)
            accounts.append({"layout": (n, batch, accumulate), "returned": returned, "taken": len(taken),
                             "syncs": len(syncs), "batches": len(loader), "agree": bool(torch.equal(every[0], every[1]))})
        return accounts

    quiet_lightning()
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook", plugins=[LightningEnvironment()])
    spawn_log = logging.getLogger("torch.multiprocessing.spawn")  # "Terminating process ..." when a rank fails
    level = spawn_log.level
    spawn_log.setLevel(logging.ERROR)
    with environment_kept():  # Fabric sets MASTER_PORT in this process; later launches must not inherit it
        try:
            return fabric.launch(run)
        except Exception as exc:  # a rank's error comes back wrapped, its traceback in the text
            lines = [line for line in str(exc).splitlines() if line.strip()]
            last = lines[-1] if lines else first_line(exc)
            if "ExerciseNotDone: " in last:  # the cell still holds its NotImplementedError
                raise ExerciseNotDone(last.split("ExerciseNotDone: ", 1)[1]) from None
            raise WrongAnswer(f"your function raised on a rank: {last}") from None
        finally:
            spawn_log.setLevel(level)


def check_fabric_epoch(epoch: Callable[..., int], measured: Sequence[Mapping[str, int]]) -> None:
    """``epoch(fabric, model, optimizer, loader, accumulate)``: one epoch with gradient accumulation, returning
    its optimiser steps. Run on 2 forked ranks on the layouts Lightning ran on 2 ranks (``measured``: rows of
    ``n_train``, ``batch_size``, ``world_size``, ``grad_accum``, ``epochs`` and the ``global_step`` Lightning
    counted), then on others."""
    two = [r for r in measured if r["world_size"] == 2]  # the check's ranks: 2
    lightning = {(r["n_train"], r["batch_size"], r["grad_accum"]): r["global_step"] // r["epochs"] for r in two}
    accounts = fabric_accounts(epoch, [*lightning, *FABRIC_CASES])
    for a in accounts:
        (n, batch, accumulate), want = a["layout"], -(-a["batches"] // a["layout"][2])
        if lightning.get(a["layout"], want) != want:  # the check's own loaders would not be Lightning's
            raise RuntimeError(f"{a['layout']}: Lightning took {lightning[a['layout']]} steps an epoch, the check's "
                               f"loaders make {want}; the check needs mending, not your answer")
        where = f"{n} images, batches of {batch} on 2 ranks ({a['batches']} a rank), accumulate {accumulate}"
        if a["taken"] != want:
            raise WrongAnswer(f"{where}: your loop took {a['taken']} optimiser steps, not {want}"
                              + (f" (Lightning took {lightning[a['layout']]})" if a["layout"] in lightning else "")
                              + ": one step per group of accumulate batches, and the last, shorter group steps too")
        if a["returned"] != a["taken"]:
            raise WrongAnswer(f"{where}: your function says {a['returned']} steps; the optimiser took {a['taken']}")
        if a["syncs"] != a["taken"]:
            raise WrongAnswer(f"{where}: the ranks all-reduced their gradients {a['syncs']} times for {a['taken']} "
                              "steps: only the backward pass right before a step needs them whole "
                              "(fabric.no_backward_sync for the others)")
        if not a["agree"]:
            raise WrongAnswer(f"{where}: the two ranks ended with different weights: each step must use gradients "
                              "that every rank all-reduced")
    passed("one all-reduce and one step per group of accumulate batches, the last, shorter group included: "
           + ", ".join(f"{a['taken']} steps on {a['batches']} batches a rank" for a in accounts))


# (parameters, ranks, GPU bytes, precision) -> the smallest ZeRO stage whose model states fit: FT3's A100-40GB,
# 2 per node, on 1, 2 and 8 nodes, and a model too large for any stage. The fp32 cases fit the textbook's 16 bytes
# per parameter one stage lower than DeepSpeed's 20 (its fp32 copy of the weights is kept in fp32 runs too)
STAGE_CASES = {(1_500_000_000, 2, 40e9, "bf16"): 0, (3_000_000_000, 2, 40e9, "bf16"): 1,
               (7_000_000_000, 8, 40e9, "bf16"): 1,  # the prompt's prediction: 2 + 2 + 12/8 bytes, 38.5 GB
               (6_000_000_000, 4, 40e9, "bf16"): 2, (20_000_000_000, 16, 40e9, "bf16"): 3,
               (70_000_000_000, 8, 40e9, "bf16"): None, (7_000_000_000, 1, 80e9, "bf16"): None,
               (2_200_000_000, 2, 40e9, "fp32"): 1, (4_300_000_000, 8, 40e9, "fp32"): 2,
               (70_000_000_000, 8, 40e9, "fp32"): None}


def deepspeed_reads(config: Mapping[str, Any]) -> tuple[int, bool]:
    """The ZeRO stage DeepSpeed reads from ``config``, and whether it trains in 16-bit mixed precision: read by
    DeepSpeed's own ``DeepSpeedConfig`` (no process group needed; ``train_batch_size``, which DeepSpeed checks
    against the ranks at ``initialize``, left out). A key DeepSpeed does not know at the top level is ignored,
    as it is in a run; one inside ``zero_optimization`` is refused."""
    import copy
    import logging

    from ..launch import temporary_env
    from ..sharding import deepspeed_env

    with temporary_env(deepspeed_env(use_gpu=False)):
        from deepspeed.runtime.config import DeepSpeedConfig
        from deepspeed.utils import logger
    level = logger.level
    logger.setLevel(logging.WARNING)  # its INFO lines say nothing the learner asked
    try:
        parsed = DeepSpeedConfig({k: copy.deepcopy(v) for k, v in config.items() if k != "train_batch_size"})
    except Exception as exc:
        raise WrongAnswer(f"DeepSpeed refused your configuration: {first_line(exc)}") from None
    finally:
        logger.setLevel(level)
    return parsed.zero_optimization_stage, bool(parsed.bfloat16_config.enabled or parsed.float16_config.enabled)


def check_ds_config(config_for: Callable[[int, int, float, str], Mapping[str, Any] | None],
                    measured: Sequence[Mapping[str, Any]]) -> None:
    """``config_for(psi, ranks, gpu_bytes, precision)``: a DeepSpeed configuration (a dict) with the lowest ZeRO
    stage whose params, gradients and AdamW state fit in ``gpu_bytes`` per rank, training in ``precision``
    ("bf16": mixed, or "fp32"), or None. Judged by what DeepSpeed reads from it (:func:`deepspeed_reads`): first
    against the runs (given exactly the bytes stage k measured per rank, the answer is stage k: a lower stage does
    not fit in them, stage k does), then against FT3-sized cases."""
    cases = [((r["psi"], r["world_size"], r["measured_bytes"], r.get("precision", "bf16")), r["zero_stage"],
              f"stage {r['zero_stage']}'s measured bytes in {r.get('precision', 'bf16')}")
             for r in sorted(measured, key=lambda r: (r.get("precision", "bf16"), r["zero_stage"]))]
    cases += [(args, want, "an FT3-sized case") for args, want in STAGE_CASES.items()]
    for (psi, ranks, gpu, precision), want, what in cases:
        config = config_for(psi, ranks, gpu, precision)
        where = f"{psi:,} parameters in {precision} on {ranks} rank(s) of {gpu / 1e9:g} GB ({what})"
        if config is None or want is None:
            if config is not want:
                raise WrongAnswer(f"{where}: you return {'None' if config is None else 'a configuration'}, but "
                                  f"{'no stage fits' if want is None else 'a stage fits'}")
            continue
        if not isinstance(config, Mapping):
            raise WrongAnswer(f"{where}: a DeepSpeed configuration is a dict (section 2 printed one), not {config!r}")
        stage, sixteen_bit = deepspeed_reads(config)
        if sixteen_bit != (precision != "fp32"):
            raise WrongAnswer(f"{where}: DeepSpeed reads {'a 16-bit' if sixteen_bit else 'no bf16 or fp16'} section "
                              f"from your configuration, so it trains in {'mixed precision' if sixteen_bit else 'fp32'}")
        if stage != want:
            raise WrongAnswer(f"{where}: DeepSpeed reads stage {stage} from your configuration. Stage 1 divides the "
                              "optimizer state by the ranks, stage 2 also the gradients, stage 3 also the weights; "
                              "count each part's bytes per parameter as DeepSpeed held them (sections 3 and 4), "
                              "and the lowest stage that fits communicates least")
    passed("the lowest stage that fits, as DeepSpeed reads it: 2 + 2 + 12 bytes per parameter in bf16, and in fp32 "
           "4 + 4 + 12, not the textbook's 4 + 4 + 8: DeepSpeed keeps its fp32 copy of the weights in an fp32 run too")


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
# 08: a search space whose learning rate follows the batch (notebook 03's rule)
# --------------------------------------------------------------------------- #
SCALED_BATCHES, BASE_LR = (32, 64, 128), (1e-3, 1e-1)


def draw_configs(space: Mapping[str, Any], n: int = 3000, seed: int = 0) -> list[dict[str, Any]]:
    """``n`` trials' configurations drawn from ``space`` by Tune's own variant generator, as ``Tuner`` draws
    them (one draw per trial; ``tune.sample_from`` resolved against the other values)."""
    import numpy as np
    from ray.tune.search.variant_generator import generate_variants

    rng = np.random.RandomState(seed)
    return [config for _ in range(n) for _, config in generate_variants(dict(space), random_state=rng)]


def scaled_space_verdict(configs: Sequence[Mapping[str, Any]]) -> str | None:
    """Why the drawn configurations do not follow ``lr = base x batch_size / 32`` with the batch from
    :data:`SCALED_BATCHES` and the base log-uniform over :data:`BASE_LR`, or None if they do. Tolerances:
    5 points on a share of 3,000 draws (about 6 standard errors)."""
    from ..tuning.trial import trial_settings

    n = len(configs)
    if not all("lr" in c and "batch_size" in c for c in configs):
        return "every trial needs an 'lr' and a 'batch_size' (the keys the course's trial reads)"
    try:
        trial_settings(configs[0])
    except (TypeError, ValueError) as exc:
        return f"the course's trial would stop on this configuration: {exc}"
    batches = [c["batch_size"] for c in configs]
    if set(batches) != set(SCALED_BATCHES) or any(abs(batches.count(b) / n - 1 / 3) > 0.05 for b in SCALED_BATCHES):
        shares = {b: f"{batches.count(b) / n:.0%}" for b in sorted(set(batches), key=str)[:8]}
        return f"batch sizes drawn: {shares}; each of {SCALED_BATCHES} should come a third of the time"
    base = [c["lr"] * 32 / c["batch_size"] for c in configs]
    low, high = BASE_LR
    if min(base) < low * (1 - 1e-9) or max(base) > high * (1 + 1e-9):
        return (f"lr x 32 / batch_size ranges from {min(base):.2g} to {max(base):.2g}: the base is drawn between "
                f"{low:g} and {high:g}, and lr follows the batch (notebook 03's rule)")
    if len(set(base)) < n / 2:
        return f"only {len(set(base))} different base rates in {n} draws: draw the base from a continuous range"
    for b in SCALED_BATCHES:
        mine = [x for x, batch in zip(base, batches) if batch == b]
        below = sum(x < (low * high) ** 0.5 for x in mine) / len(mine)
        if abs(below - 0.5) > 0.08:
            return (f"with batch_size {b}, {below:.0%} of the base rates fall in the lower decade "
                    f"[{low:g}, {(low * high) ** 0.5:g}): each decade should be equally likely")
    return None


def check_search_space(space: Callable[[], Mapping[str, Any]], search: Callable[..., Any] | None = None) -> None:
    """``space()``: a Tune search space whose trials get ``batch_size`` from :data:`SCALED_BATCHES` and
    ``lr = base x batch_size / 32``, the base log-uniform over :data:`BASE_LR`; judged on 3,000 draws, then
    (given ``search``: ``search(space, name=..., num_samples=...)`` -> a ResultGrid, the notebook's
    ``tuning.run_search`` with its settings) on two trials Tune runs from it: each must train with its draw."""
    got = space()
    if not isinstance(got, Mapping):
        raise WrongAnswer(f"a search space is a dict (tune.Tuner's param_space), not {got!r}")
    try:
        configs = draw_configs(got)
    except Exception as exc:
        raise WrongAnswer(f"Tune could not draw from your space: {type(exc).__name__}: {exc}") from None
    verdict = scaled_space_verdict(configs)
    if verdict:
        raise WrongAnswer(verdict)
    shares = {b: sum(c["batch_size"] == b for c in configs) / len(configs) for b in SCALED_BATCHES}
    print(f"{len(configs):,} draws: batch sizes {', '.join(f'{b} {s:.0%}' for b, s in shares.items())}; "
          f"lr from {min(c['lr'] for c in configs):.2g} to {max(c['lr'] for c in configs):.2g}")
    if search is not None:
        from ..tuning.report import trials

        grid = search(got, name="exercise", num_samples=2)
        for result in grid:
            if result.error:
                raise WrongAnswer(f"a trial of your space failed: {first_line(result.error)}")
        for row in trials(grid, 1):
            cfg = row["config"]
            used = row["lr"][0] if row["lr"] else None
            if used is None or abs(used - cfg["lr"]) > 1e-9 * cfg["lr"]:
                raise WrongAnswer(f"Tune drew lr {cfg['lr']:.3g} for a trial, and its optimiser used {used}")
            print(f"a trial Tune ran: batch_size {cfg['batch_size']}, base {cfg['lr'] * 32 / cfg['batch_size']:.3g}"
                  f", its optimiser's lr {used:.3g}")
    passed("the base log-uniform, the batch a choice, and lr resolved from both with tune.sample_from")
