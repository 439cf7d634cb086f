"""The claims of the notebooks' runs, one call each after the run's output (notebooks 01-05): 01's program, the
launchers and collectives of 02 and 04, what train.py under torchrun showed, and what the take-home scripts (scripts/plain_*.py)
and their job files did."""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

from .claims import verify
from .launch import RunResult
from .results import plain_epochs, plain_steps, plain_summary


def check_ddp_run(run: RunResult, result: dict, run_dir: Path, ranks: int) -> None:
    """train.py under torchrun on ``ranks`` ranks, its checkpoints in ``run_dir/ckpt``, its TensorBoard files in
    ``run_dir/tb``."""
    losses = result["train_loss"]
    saved = sorted(p.name for p in (run_dir / "ckpt").iterdir())
    verify([
        (f"train.py found torchrun's {ranks} ranks", result["world_size"] == ranks
         and f"launcher=torchrun rank=0/{ranks}" in run.output),
        (f"the loss fell under DDP: {losses[0]:.3f} -> {losses[-1]:.3f}", losses[-1] < losses[0]),
        ("every rank ended with the same weights: DDP averaged the same gradients everywhere", result["ranks_agree"]),
        ("only rank 0 reported", sum(line.startswith("RESULT") for line in run.lines) == 1),
        (f"only rank 0 wrote checkpoints: {', '.join(saved)}", saved in (["last.pt"], ["last.prev.pt", "last.pt"])),
        ("only rank 0 wrote TensorBoard events: one file",
         len(list((run_dir / "tb").glob("events.out.tfevents.*"))) == 1),
    ], detail=run.output[-2000:])


def check_plain_ddp(single: RunResult, ddp: RunResult, ranks: int) -> None:
    """plain_single.py on one device and plain_ddp.py on ``ranks`` ranks, from the same data."""
    one, many, done = plain_epochs(single.output), plain_epochs(ddp.output), plain_summary(ddp.output)
    verify([
        (f"one device trained: the loss fell from {one[0]:.3f} to {one[-1]:.3f}", one[-1] < one[0]),
        (f"{ranks} ranks trained: the loss fell from {many[0]:.3f} to {many[-1]:.3f}", many[-1] < many[0]),
        (f"each rank took 1/{ranks} of an epoch's batches ({plain_steps(ddp.output)[0]} steps, not "
         f"{plain_steps(single.output)[0]}): the sampler split the data",
         plain_steps(ddp.output)[0] == plain_steps(single.output)[0] // ranks),
        ("only rank 0 printed: one line per epoch", len(many) == len(one)),
        (f"all {ranks} ranks ended with identical weights", done["world_size"] == ranks and done["identical"]),
    ], detail=ddp.output[-2000:])


def check_plain_job(record: dict, log: str, nodes: int, per_node: int) -> None:
    """A Slurm job of plain_ddp.py or plain_resumable.py (slurm/ddp_one_file.sbatch, a TRAIN_SCRIPT through a
    pattern): ``nodes`` x ``per_node`` ranks trained one model."""
    losses, done = plain_epochs(log), plain_summary(log)
    verify([
        (f"the job completed on {record['NodeList']}", record["JobState"] == "COMPLETED"),
        (f"{nodes * per_node} ranks, {per_node} on each of {nodes} nodes, formed one group",
         (done["world_size"], done["per_node"]) == (nodes * per_node, per_node)),
        (f"the loss fell from {losses[0]:.3f} to {losses[-1]:.3f}", len(losses) > 1 and losses[-1] < losses[0]),
        ("every rank ended with identical weights", done["identical"]),
    ], detail=log[-2000:])


def _same_step(stopped: str, resumed: str, steps: list[int]) -> bool:
    """Whether "resumed from ...: epoch E, after batch B" is the step "epoch E, after batch B" stopped at: the last
    batch of an epoch is saved as the start of the next (epoch E + 1, after batch 0)."""
    def step(text: str) -> tuple[int, int] | None:
        found = re.search(r"epoch (\d+), after batch (\d+)", text)
        return (int(found[1]), int(found[2])) if found else None

    (e, b), again = step(stopped) or (-1, -1), step(resumed)
    return again is not None and (again == (e, b) or again == (e + 1, 0) and b in steps)


def check_requeued_job(record: dict, log: str, ckpt: Path, epochs: int) -> None:
    """slurm/ddp_requeue_one_file.sbatch's job, warned once: it stopped, requeued itself and finished from there."""
    lines = log.splitlines()
    stopped = next((x for x in lines if x.startswith("stopped on SIGUSR1")), "")
    resumed = next((x for x in lines if x.startswith("resumed from")), "")
    where = stopped.split(" in ", 1)[-1].split(";")[0]  # "epoch E, after batch B"
    verify([
        ("Slurm requeued the job once and it completed",
         (record["JobState"], record["Restarts"]) == ("COMPLETED", "1")),
        (f"the first start stopped on the warning, every rank at one step ({where}), with a checkpoint",
         bool(stopped) and str(ckpt.name) in stopped),
        ("the second start resumed from that step", _same_step(where, resumed, plain_steps(log))),
        (f"and trained to the end: epoch {epochs - 1}", len(plain_epochs(log)) > 0 and f"epoch {epochs - 1}: " in log),
        ("every rank ended with identical weights", plain_summary(log)["identical"]),
    ], detail=log[-2000:])


def check_restarted_plain(run: RunResult, saved: dict, epochs: int) -> None:
    """plain_resumable.py under torchrun --max-restarts=1, a rank killed after the checkpoint ``saved``."""
    resumed = next((x for x in run.lines if x.startswith("resumed from")), "")
    verify([
        ("torchrun saw a rank die and started the group again", "exitcode: -9" in run.output and bool(resumed)),
        (f"the new ranks went on from the checkpoint, at or after epoch {saved['epoch']}, batch {saved['batch']}",
         lambda: tuple(int(x) for x in resumed.replace(",", "").split()[-4::3]) >= (saved["epoch"], saved["batch"])),
        (f"and trained to the end: epoch {epochs - 1}", f"\nepoch {epochs - 1}: " in run.output),
        ("every rank ended with identical weights", lambda: plain_summary(run.output)["identical"]),
    ], detail=run.output[-2000:])


def check_n_by_b(checks: dict, steps: int) -> None:
    """scripts/ddp_checks.py's RESULT: N ranks x B against 1 process x N*B, from the same seed and images."""
    verify([
        ("each rank's local gradients differed, and were bit-identical on every rank after DDP's all-reduce",
         checks["local_grads_differed"] and checks["grads_identical"]),
        (f"after {steps} steps, N x B and 1 x N*B agree within the float64 tolerance derived from the sums "
         f"({checks['max_abs_diff']:.1e} <= {checks['float64_atol']:.1e})",
         checks["within_tolerance"] and checks["ranks_identical"] and checks["steps"] == steps),
        (f"training moved the weights far more than that ({checks['max_moved']:.2g}, over 100 times as much)",
         checks["max_moved"] > 100 * checks["max_abs_diff"]),
        (f"a DDP that sums the gradients instead misses by {checks['summed_max_abs_diff']:.2g}, over a million "
         "times the tolerance", checks["summed_max_abs_diff"] > 1e6 * checks["float64_atol"]),
    ])


def check_buckets(rows: list[dict]) -> None:
    """scripts/ddp_buckets.py's rows: all-reduce calls per step by bucket size, and with accumulation."""
    by_cap = {r["bucket_cap_mb"]: r["allreduces_per_step"] for r in rows if r["accum"] == 1 and not r["grad_as_bucket_view"]}
    accum = {r["no_sync"]: r["allreduces_per_step"] for r in rows if r["accum"] == 4}
    verify([
        (f"smaller buckets, more all-reduces a step: {by_cap[1.0]:g} at 1 MB, {by_cap[25.0]:g} at 25 MB, "
         f"{by_cap[100.0]:g} at 100 MB", by_cap[1.0] > by_cap[25.0] > by_cap[100.0] >= 1),
        (f"4 micro-batches: {accum[True]:g} all-reduce(s) with no_sync, {accum[False]:g} without, 4 times as many",
         accum[False] == 4 * accum[True]),
    ])


def check_killed_and_resumed(output: str, saved: dict, reference: dict, restarted: dict, device: str) -> None:
    """train.py's run with a rank killed after the mid-epoch checkpoint ``saved``, against the undisturbed run."""
    verify([
        ("the restarted group resumed in the middle of the epoch", "resumed from" in output and "(after batch " in output),
        (f"the checkpoint it resumed from was a step checkpoint ({saved['in_epoch']['batches']} batches, a multiple "
         "of 5), and both runs ended at the same epoch",
         saved["in_epoch"]["batches"] % 5 == 0 and restarted["epoch"] == reference["epoch"]),
        (f"its final state (weights and BatchNorm's statistics) is bit for bit the undisturbed run's, on {device}",
         all(torch.equal(reference["model"][k], restarted["model"][k]) for k in reference["model"])),
        ("and so is every epoch's loss",
         [h["train_loss"] for h in reference["history"]] == [h["train_loss"] for h in restarted["history"]]),
    ])


def check_elastic(worlds: list[str], output: str, final_epoch: int, epochs: int) -> None:
    """The surviving elastic node's run: the world sizes its workers saw, and its last checkpoint's epoch."""
    verify([
        (f"the job started with 2 nodes and finished with 1 (rank/world seen: {', '.join(worlds)})",
         worlds[0] == "0/2" and worlds[-1] == "0/1"),
        (f"the survivor resumed from the checkpoint and finished all {epochs} epochs",
         "resumed from" in output and final_epoch == epochs),
    ])


def check_requeued_train(record: dict, first: dict, final: dict, ckpt: Path, epochs: int) -> None:
    """slurm/<site>/requeue.sbatch's job of train.py, warned once: what each start reported (its RESULT line)."""
    verify([
        ("Slurm requeued the job once and it completed",
         (record["JobState"], record["Restarts"]) == ("COMPLETED", "1")),
        (f"the first start began afresh and stopped on the warning, after step {first['global_step']}",
         first["stopped"] and first["resumed_from"] is None),
        ("the second start went on from the checkpoint the first wrote when it stopped",
         lambda: Path(final["resumed_from"]["path"]) == ckpt and final["resumed_from"]["step"] == first["global_step"]),
        (f"mid-epoch, after batch {final['resumed_from']['batch'] if final['resumed_from'] else '?'} of its epoch: no "
         "batch was trained twice", lambda: bool(final["resumed_from"]["batch"])),
        (f"and it finished the run's {epochs} epochs", not final["stopped"] and final["epochs"] == epochs),
    ])


def check_launcher_env(srun: "object") -> None:
    """02: what detect_env makes of the variables srun gives task 3 of a 4-task, 2-node job (job id 81234)."""
    verify([
        (f"srun's task 3 is rank {srun.rank} of {srun.world_size}, local rank {srun.local_rank}, rank 0 on "
         f"{srun.master_addr} (the node list's first)",
         (srun.rank, srun.local_rank, srun.world_size, srun.master_addr) == (3, 1, 4, "gpu-a01")),
        (f"without MASTER_PORT the port comes from the job id: {srun.master_port}",
         srun.master_port == 20000 + 81234 % 20000),
    ])


def check_placements(answers: dict) -> None:
    """02: place_ranks' answers for the three layouts of the cell, by --device."""
    verify([
        ("2 FT3 nodes under srun --gpus-per-task=1: each task's only GPU is its cuda:0",
         answers["2 FT3 nodes, srun --gpus-per-task=1", "cuda"] == ["cuda:0"] * 4),
        ("a 1-GPU portal session: four NCCL ranks cannot share its GPU, --device cuda is refused",
         answers["1-GPU portal session, 4 ranks", "cuda"] == "error"),
        ("and --device auto falls back to gloo on the CPU", answers["1-GPU portal session, 4 ranks", "auto"] == ["cpu"] * 4),
    ])


def check_bandwidth(bench: dict) -> None:
    """02: allreduce_bench.py's JSON: the hand-written ring against all_reduce, and bandwidth over message sizes
    (algorithm bandwidth, as the script's table prints it: beside the chart's bus bandwidth it would give away the
    exercise's factor)."""
    builtin = sorted((r["bytes"], r["algbw"]) for r in bench["rows"] if r["impl"] == "builtin")
    small, large = builtin[0][1], builtin[-1][1]
    verify([
        (f"the ring computes what all_reduce computes (int64 identical, float64 within {bench['ring_max_rel_diff']:.0e})",
         bench["ring_int_exact"] and bench["ring_max_rel_diff"] < 1e-12),
        (f"small messages are latency-bound, large ones bandwidth-bound: {small:.4f} GB/s of algorithm bandwidth "
         f"(the table's) at the smallest, {large:.3f} GB/s at the largest", large > 10 * small),
    ])


def check_param_servers(ps: dict) -> None:
    """02: param_server.py's three schemes, one worker a 3x straggler."""
    sync, asyn = ps["sync-ps"], ps["async-ps"]
    verify([
        (f"the asynchronous server does not wait for the straggler: the same {asyn['gradients']} gradients at "
         f"{asyn['grads_per_s']:.0f}/s against the synchronous server's {sync['grads_per_s']:.0f}/s",
         asyn["grads_per_s"] > sync["grads_per_s"]),
        (f"so the fast workers contribute more: {asyn['gradients_per_worker']} (the last is the straggler)",
         asyn["gradients_per_worker"][-1] < max(asyn["gradients_per_worker"])),
        (f"and it pays with gradients computed on old parameters: a mean staleness of {asyn['mean_staleness']:.1f}",
         asyn["mean_staleness"] > 0),
        (f"the server is the bottleneck: {sync['busiest_rank_mib_per_round']:.1f} MiB a round through its busiest rank, "
         f"{ps['allreduce']['busiest_rank_mib_per_round']:.1f} for the all-reduce",
         sync["busiest_rank_mib_per_round"] > ps["allreduce"]["busiest_rank_mib_per_round"]),
    ])


def check_collective_timeout(run: RunResult, label: str) -> None:
    """04: collective_timeout.py on 2 ranks, a 5 s collective timeout, one rank that never joins."""
    verify([
        (f"a rank that never joins a collective fails the job ({label}: exit code {run.returncode})", run.returncode != 0),
        ("rank 0's collective raised at the timeout", "rank 0: the all_reduce failed after" in run.output),
        ("and did not return as if it had worked", "returned, which it must not" not in run.output),
        (f"the 5 s collective timeout ended the job after {run.seconds:.0f} s, not the launcher's 120 s limit",
         run.seconds < 60),
    ], detail=run.output[-2000:])


def check_submitit_ranks(ranks: list[dict], nodes: int | None) -> None:
    """04: what submitit's job returned from every task; ``nodes`` where it ran under Slurm."""
    world = ranks[0]["world"]
    verify([
        (f"the tasks were ranks 0 to {world - 1}, and every one all-reduced their sum, {world * (world - 1) // 2}",
         [r["rank"] for r in ranks] == list(range(world)) and all(r["sum"] == world * (world - 1) / 2 for r in ranks)),
        (f"every task met at one address, {ranks[0]['rendezvous']}", len({r["rendezvous"] for r in ranks}) == 1),
        *([(f"the tasks ran on all {nodes} nodes of the job", len({r["host"] for r in ranks}) == nodes)] if nodes else []),
    ])


def check_script_run(result: dict, run_dir: Path, epochs: int) -> None:
    """01: the ladder's best configuration run as scripts/train.py, its checkpoint and logs in ``run_dir``."""
    losses = result["train_loss"]
    verify([
        (f"the program ran the configuration it was given: one process, {epochs} epochs",
         result["world_size"] == 1 and result["epochs"] == epochs),
        (f"and it learns: {losses[0]:.3f} -> {losses[-1]:.3f}", losses[-1] < losses[0]),
        ("its checkpoint and its TensorBoard log are where the flags said",
         (run_dir / "ckpt" / "last.pt").exists() and bool(list((run_dir / "tb").glob("events.out.tfevents.*")))),
    ])


def check_four_trainers(rows: dict[str, dict], world: int) -> None:
    """06: the course Trainer, the loop by hand, Lightning and Fabric, on one seed, data order and arithmetic."""
    base = rows["course Trainer"]
    apart = {name: r["val_loss"] for name, r in rows.items() if r["val_loss"] != base["val_loss"]}
    verify([
        (f"every trainer ran {world} ranks whose weights agree",
         all(r["ranks_agree"] and r["world_size"] == world for r in rows.values())),
        (f"each took the same {base['global_step']} optimiser steps, and its training loss fell",
         all(r["global_step"] == base["global_step"] and r["train_loss"][-1] < r["train_loss"][0]
             for r in rows.values())),
        (f"all four ended at one validation loss, bit for bit: {base['val_loss']!r}", not apart),
        ("Fabric's second run went on from the first's checkpoint, written after epoch 1",
         rows["Fabric"]["resumed_from"]["epoch"] == 1),
    ], detail=lambda: f"validation losses apart from the course Trainer's: {apart}")


def check_asha_against_fifo(asha_rows: list[dict], fifo_rows: list[dict], asha: dict, fifo: dict,
                            bad: tuple[float, float], on_gpu: bool) -> None:
    """08: the same draws searched with ASHA and run to the end (FIFO), and a deliberately bad configuration, all
    scored on the same held-out images. ``*_rows``: tuning.trials; ``asha``, ``fifo``: their summaries."""
    to_the_end = {str(r["config"]): r["val_loss"] for r in fifo_rows}
    same = 2e-2 if on_gpu else 1e-6  # bit for bit on a CPU, within a GPU's nondeterministic kernels
    wrongly_stopped = [r for r in asha_rows if r["status"] == "stopped early" and not any(
        o["epochs"] > r["epochs"] and o["val_loss"][r["epochs"] - 1] <= r["val_loss"][r["epochs"] - 1]
        for o in asha_rows)]
    bad_loss, bad_acc = bad
    verify([
        ("no trial of either search errored", asha["errored"] == fifo["errored"] == 0),
        ("ASHA cut trials short and changed nothing else: each trained as the same draw did when run to the end",
         all(all(math.isclose(a, b, rel_tol=same) for a, b in zip(r["val_loss"], to_the_end[str(r["config"])]))
             for r in asha_rows)),
        (f"ASHA stopped {asha['stopped_early']} trial(s) early and spent {asha['epochs']} of FIFO's {fifo['epochs']} "
         "epochs", asha["stopped_early"] >= 1 and asha["epochs"] < fifo["epochs"]),
        ("the trial best after its first epoch went on past the first rung",
         min(asha_rows, key=lambda r: r["val_loss"][0])["epochs"] > 1),
        ("each trial ASHA stopped at a rung was behind, there, a trial that went on", not wrongly_stopped),
        (f"the search found a better model than a bad configuration, on held-out images: accuracy "
         f"{fifo['held_out_acc']:.3f} against {bad_acc:.3f}",
         fifo["held_out_loss"] < bad_loss and fifo["held_out_acc"] > bad_acc + 0.05),
    ], detail=lambda: f"stopped although no trial that went on was ahead: {[r['config'] for r in wrongly_stopped]}")


def check_lightning_jobs(bad: dict, per_node: int, good: dict, epochs: int, steps_per_epoch: int) -> None:
    """06: multi_node_lightning.sbatch twice. ``bad``: the job with --devices 1 (its record, log and error lines);
    ``good``: the job warned, requeued and resumed (its record, each start's result, the checkpoint's path)."""
    record, first, final = good["record"], good["first"], good["final"]
    stopped_at = first["global_step"]
    verify([
        (f"the job with --devices 1 stopped before training, in one line naming the fix (pass --devices {per_node})",
         bad["record"]["JobState"] == "FAILED" and len(bad["errors"]) == 1
         and f"pass --devices {per_node}" in bad["errors"][0]),
        ("with no traceback and no training", 'train_lightning.py", line' not in bad["log"]
         and "RESULT" not in bad["log"]),
        ("Slurm requeued the other job once and it completed", record["JobState"] == "COMPLETED"
         and record["Restarts"] == "1"),
        (f"its first start began afresh and stopped on the warning, at step {stopped_at}, before the last "
         f"({epochs * steps_per_epoch})", first["stopped"] and first["resumed_from"] is None
         and stopped_at < epochs * steps_per_epoch),
        (f"the second start resumed from {Path(good['ckpt']).name}, at the step the first stopped at",
         final["resumed_from"] == str(good["ckpt"]) and not final["stopped"] and final["resumed_at_step"] == stopped_at),
        (f"and trained every step once: {final['global_step']} steps, {final['epochs']} epochs",
         final["global_step"] == epochs * steps_per_epoch and final["epochs"] == epochs),
    ])
