"""Notebook 07: DeepSpeed's estimators against the theory, the ZeRO stages measured, their bytes sent, the three
switches on stage 2, ZeRO's and FSDP2's checkpoints resumed (also on another number of ranks), FSDP2 against ZeRO-3.

``stages`` and the other runs are the RESULT dicts of scripts/train_deepspeed.py and scripts/train_fsdp.py."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..claims import verify
from ..sharding import PARTS, deepspeed_comm, model_state_bytes

# ZeRO pads each flat shard (stages 1-2) or each weight (stage 3) up to a multiple of the ranks: a few elements
PAD_PER_RANK = 64  # bytes per part, times the ranks
# bytes sent: the padding and a few scalars (the gradient norm, the overflow flag) are well under 1 % of a step's
# bytes on any number of ranks, and a count off by a factor of N-1 or 2 is far outside it
SENT_TOL = 0.01


def check_zero_estimators(estimate: Mapping[int, float], paper: Mapping[int, float], psi: int, largest: int,
                          gpus: int, figure_1: Mapping[int, float]) -> None:
    """The course's theory (``paper``, bytes per GPU by stage) against the ZeRO paper's Figure 1 (``figure_1``, GB as
    printed there), then DeepSpeed's ``estimate_zero{2,3}_model_states_mem_needs_all_cold`` (bytes per GPU, no
    offload) against the theory, for ``psi`` parameters on ``gpus`` GPUs, ``largest`` the largest layer's size."""
    extra2 = (18 - 14) * psi / gpus
    extra3 = (18 - 16) * psi / gpus + 4 * largest
    verify([
        ("the theory gives the paper's Figure 1, to the GB's first decimal, for every stage",
         all(round(paper[s] / 1e9, 1) == figure_1[s] for s in figure_1)),
        (f"stage 2: DeepSpeed's estimate is the theory plus {extra2 / 1e9:.2f} GB, 18 bytes per parameter over "
         f"{gpus} where the paper shards 14", abs(estimate[2] - paper[2] - extra2) < 0.01e9),
        (f"stage 3: the theory plus {extra3 / 1e9:.2f} GB, 18 bytes over {gpus} where the paper shards 16, and the "
         "largest layer gathered whole at 4 bytes a parameter", abs(estimate[3] - paper[3] - extra3) < 0.01e9),
    ])


def check_zero_stages(stages: Mapping[int, dict], ranks: int) -> None:
    """The four stages' runs: what each rank held against ``zero_theory``, and that each trained."""
    off = {(s, p): r["memory"][p] - r["theory"][p] for s, r in stages.items() for p in PARTS}
    totals = [model_state_bytes(r["memory"]) for r in stages.values()]
    verify([
        (f"every part of every stage is the theory's bytes, within ZeRO's padding ({PAD_PER_RANK * ranks} B): "
         f"at most {max(map(abs, off.values())):,.0f} B apart", all(abs(d) <= PAD_PER_RANK * ranks for d in off.values())),
        ("each stage up held less per rank: " + " > ".join(f"{t / 2**20:.2f}" for t in totals) + " MiB",
         all(a > b for a, b in zip(totals, totals[1:]))),
        ("the optimizer state is the largest part of the unsharded state",
         max(PARTS, key=lambda p: stages[0]["memory"][p]) == "optimizer"),
        ("every stage trained: its loss fell and its ranks ended in agreement",
         all(r["ranks_agree"] and r["train_loss"][-1] < r["train_loss"][0] for r in stages.values())),
    ], detail=lambda: f"measured minus theory, bytes: {off}")


def check_zero_comm(stages: Mapping[int, dict], psi: int, ranks: int, precision: str, accum: int, wire: str) -> None:
    """What each stage sent in its first optimizer step, counted by DeepSpeed's comms logger and at torch's
    dispatcher, against DeepSpeed's collectives (``deepspeed_comm``); ``wire``: the weights' dtype, torch's name."""
    apart, not_wire = [], []
    for stage, r in stages.items():
        want = deepspeed_comm(psi, ranks, stage, precision, accum)
        for source, ops in r["collectives"].items():
            for op in set(want) | set(ops):
                got = ops.get(op, {}).get("sent", 0.0)
                if abs(got - want.get(op, 0.0)) > SENT_TOL * sum(want.values()):
                    apart.append(f"stage {stage}, {op}: {source} counted {got:,.0f} B, DeepSpeed's collectives "
                                 f"{want.get(op, 0):,.0f}")
        dispatcher = r["collectives"]["dispatcher"]
        not_wire += [f"stage {stage}, {op}" for op in want
                     if dispatcher.get(op, {}).get("by_dtype", {}).get(wire, 0) < (1 - SENT_TOL) * want[op]]
    verify([
        (f"for every stage, the logger and the dispatcher counted DeepSpeed's collectives, within {SENT_TOL:.0%}, "
         "and nothing else", not apart),
        (f"each collective's bytes, all but the bookkeeping's few, in the weights' dtype, {wire}", not not_wire),
    ], detail=lambda: "\n".join(apart + [f"{x}: not sent in {wire}" for x in not_wire]))


def check_stage2_switches(knobs: Mapping[str, dict], on_gpu: bool) -> None:
    """Stage 2 in bf16, in fp32, with ZeRO-Offload and with activation checkpointing (``knobs``, by the notebook's
    row names)."""
    bf16, fp32 = knobs["bf16 (stage 2 above)"], knobs["fp32"]
    offload, recomputed = knobs["bf16 + offload"], knobs["bf16 + activation ckpt"]
    claims = [
        (f"in fp32 the weights take twice bf16's bytes ({fp32['memory']['params'] / 2**20:.2f} MiB against "
         f"{bf16['memory']['params'] / 2**20:.2f})",
         abs(fp32["memory"]["params"] - 2 * bf16["memory"]["params"]) <= PAD_PER_RANK * 4),
        # (what fp32's optimizer part says is 07's exercise: its checker judges against this run's bytes)
        (f"activation checkpointing trained the same model: validation loss {recomputed['val_loss']:.4f} against "
         f"{bf16['val_loss']:.4f}", abs(recomputed["val_loss"] - bf16["val_loss"]) <= 1e-3 * bf16["val_loss"]),
    ]
    if on_gpu:  # on a CPU-only run the state is in CPU memory either way: nothing to check
        claims += [
            ("with offload the optimizer state is in CPU memory", offload["memory"]["optimizer_device"] == "cpu"),
            (f"and the GPU holds less: {offload['allocated_mib']:,.1f} MiB allocated against {bf16['allocated_mib']:,.1f}",
             offload["allocated_mib"] < bf16["allocated_mib"]),
        ]
    verify(claims)


def check_zero_resume(first: dict, second: dict, uninterrupted: dict, on_gpu: bool) -> None:
    """A stage-3 run stopped after ``first`` and resumed as ``second``, against ``uninterrupted`` (the same run in
    one go). A restart from scratch would have the same step count and, on a CPU, the same losses: so the checks
    ask what it loaded."""
    resumed = second["resumed_from"] or {}
    same = 1e-2 if on_gpu else 0.0  # bit for bit on a CPU; GPU reductions are not bit-reproducible
    verify([
        (f"the second run resumed at step {resumed.get('step')}, where the first ended",
         resumed.get("step") == first["global_step"]),
        (f"it loaded the weights the first ended with ({first['final_weights']})",
         resumed.get("weights") == first["final_weights"]),
        (f"and continued the step count to {second['global_step']}", second["global_step"] == 2 * first["global_step"]),
        ("stopped and resumed, it trained as the uninterrupted run did, epoch by epoch"
         + (" (bit for bit)" if not same else " (within 1 %)"),
         len(second["train_loss"]) == len(uninterrupted["train_loss"])
         and all(abs(a - b) <= same * b for a, b in zip(second["train_loss"], uninterrupted["train_loss"]))),
        ("the consolidated state dict is exactly the trained fp32 weights", second["consolidated_max_abs_diff"] == 0.0),
    ])


def check_universal(whole: Mapping[str, tuple[int, Mapping[str, int]]], refusal_code: int, refusal: str,
                    one: dict, many: dict) -> None:
    """The N-rank checkpoint refused on one rank as it is (``refusal_code``, its output), converted by
    ``ds_to_universal`` (``whole``: parameter -> (its size, {file: elements})), and resumed by one rank (``one``)
    from the weights and step the N ranks (``many``) ended with."""
    resumed = one["resumed_from"] or {}
    verify([
        ("as it is, the N ranks' checkpoint is refused on one rank, in a line that names the conversion",
         refusal_code != 0 and "of another number of ranks" in refusal),
        ("converted, every parameter is whole beside its two AdamW moments: fp32, exp_avg, exp_avg_sq",
         bool(whole) and all(set(files) == {"fp32", "exp_avg", "exp_avg_sq"} and all(n == size for n in files.values())
                             for size, files in whole.values())),
        ("one rank resumed from the universal checkpoint", one["world_size"] == 1 and bool(resumed.get("universal"))),
        (f"with the weights the N ranks ended with ({many['final_weights']})", resumed.get("weights") == many["final_weights"]),
        (f"at their step, {many['global_step']}, and went on", resumed.get("step") == many["global_step"] < one["global_step"]),
    ], detail=refusal[-1500:])


def check_fsdp_against_zero3(fsdp: dict, unsynced: dict, zero3: dict, ranks: int, on_gpu: bool) -> None:
    """train_fsdp.py syncing every micro-batch (``fsdp``) and only at the step (``unsynced``), against ZeRO-3."""
    pad, psi = PAD_PER_RANK * ranks, fsdp["psi"]
    verify([
        ("syncing every micro-batch, FSDP2 holds ZeRO-3's total, 16 bytes per parameter over N",
         abs(model_state_bytes(fsdp["memory"]) - model_state_bytes(zero3["memory"])) <= 3 * pad),
        ("split as fp32 shards: weights 4 bytes per parameter over N, gradients 4, Adam's two moments 8",
         all(abs(fsdp["memory"][part] - per * psi / ranks) <= pad
             for part, per in (("params", 4), ("gradients", 4), ("optimizer", 8)))),
        ("with sync only at the step, every rank holds every gradient whole between micro-batches: 4 bytes per "
         "parameter", abs(unsynced["memory"]["gradients"] - 4 * psi) <= pad),
        (f"the same {zero3['global_step']} steps as ZeRO-3, the ranks in agreement",
         fsdp["ranks_agree"] and fsdp["global_step"] == zero3["global_step"]),
        (f"nearly the same validation loss as ZeRO-3 ({fsdp['val_loss']:.4f} against {zero3['val_loss']:.4f}): "
         "another tool, other bf16 rounding", abs(fsdp["val_loss"] - zero3["val_loss"]) < 0.05 * zero3["val_loss"]),
        ("when the gradients are reduced changes what is held and sent, not the training: the same validation loss",
         abs(unsynced["val_loss"] - fsdp["val_loss"]) <= (1e-2 if on_gpu else 1e-5) * fsdp["val_loss"]),
    ])


def check_dcp_resume(one: dict, many: dict, ranks: int, epochs: int) -> None:
    """``many``: train_fsdp.py's N-rank run that wrote a DCP checkpoint after ``epochs``; ``one``: one process that
    resumed it for one more epoch and consolidated it."""
    resumed = one["resumed_from"] or {}
    verify([
        (f"written by {ranks} ranks, read by one process", resumed.get("world_size") == ranks and one["world_size"] == 1),
        ("the finished epochs' losses came from the checkpoint", one["train_loss"][:epochs] == many["train_loss"]),
        ("it loaded the weights the N ranks ended with", resumed.get("weights") == many["final_weights"]),
        # one process steps N times as often per epoch as N ranks (the same per-rank batch)
        (f"and continued their step count, from {many['global_step']} to {one['global_step']}: one process takes "
         f"{ranks} times the steps of {ranks} ranks in an epoch",
         one["global_step"] == many["global_step"] * (epochs + ranks) // epochs),
        ("the plain state dict is exactly the trained fp32 weights", one["consolidated_max_abs_diff"] == 0.0),
    ])


def check_fsdp_transformer(unsplit: Mapping, sharded: Mapping, ranks: int, rel: float = 1e-4) -> None:
    """scripts/train_lm.py's RESULTs: the decoder (embedding and head tied) in one process at the global batch,
    and sharded by FSDP2 over ``ranks`` at batch / ranks each."""
    def gap(key: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(sharded[key], unsplit[key], strict=True))

    verify([
        (f"the {ranks} FSDP2 ranks took the unsplit run's {unsplit['tokens_per_step']:,} tokens a step",
         sharded["tokens_per_step"] == unsplit["tokens_per_step"] and sharded["world_size"] == ranks),
        (f"and trained its losses step for step, {len(unsplit['losses'])} steps within {rel:g} relative (largest "
         f"gap {gap('losses'):.1e}: fp32 sums in another order), the tied embedding and head one weight throughout",
         len(sharded["losses"]) == len(unsplit["losses"]) and gap("losses") <= rel),
        (f"with the same gradients' norm at every step (largest gap {gap('grad_norms'):.1e})", gap("grad_norms") <= rel),
    ])


def check_activation_checkpointing(measured: Mapping[str, tuple[float, float]], grads_equal: bool) -> None:
    """The decoder's one forward and backward per ``--ac`` mode: ``(peak MiB, ms)``; ``grads_equal``: whether
    every mode computed the none mode's gradients."""
    (none_mib, none_ms), (sel_mib, _), (full_mib, full_ms) = (measured[m] for m in ("none", "selective", "full"))
    verify([
        ("every mode computed the same gradients", grads_equal),
        (f"selective checkpointing lowered the peak, {none_mib:.1f} -> {sel_mib:.1f} MiB", sel_mib < none_mib),
        (f"full checkpointing lowered it most, to {full_mib:.1f} MiB", full_mib < sel_mib),
        (f"and cost time: its step took {full_ms / none_ms:.2f} x none's (each block's forward run again)",
         full_ms > none_ms),
    ])


def check_plain_fsdp(ddp: Any, first: Any, resumed: Any, ranks: int, exact: bool) -> None:
    """07 section 6: plain_ddp.py, then plain_fsdp.py stopped after its first epochs and run again with the same
    --ckpt-dir (the runs' output). ``exact``: on CPUs both compute in fp32 and a 2-rank mean is exact either way."""
    from ..results import plain_epochs, plain_shares

    by_ddp, by_fsdp = plain_epochs(ddp.output), plain_epochs(first.output) + plain_epochs(resumed.output)
    same = by_ddp == by_fsdp if exact else len(by_ddp) == len(by_fsdp) and all(
        abs(a - b) <= 0.02 * abs(a) for a, b in zip(by_ddp, by_fsdp))
    shares, held = plain_shares(resumed.output)
    verify([
        ("plain_fsdp.py trained plain_ddp.py's epochs with " + ("its losses, to the printed digit" if exact else
                                                                "its losses within 2% (bf16 on GPUs)"), same),
        (f"run again with the same --ckpt-dir, it resumed from its DCP checkpoint and trained only the last "
         f"{len(plain_epochs(resumed.output))} epoch(s)",
         "resumed from " in resumed.output and 0 < len(plain_epochs(resumed.output)) < len(by_ddp)),
        (f"its {ranks} ranks held {shares} parameters: together the model's {held:,}, each a part",
         len(shares) == ranks and sum(shares) == held and (ranks == 1 or max(shares) < held)),
    ], detail=lambda: f"plain_ddp.py {by_ddp}, plain_fsdp.py {by_fsdp}")
