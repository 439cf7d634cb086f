"""Notebook 09: the pipeline's schedules against the unsplit model and the bubble's formula, tensor and sequence
parallelism against the unsplit blocks and Megatron's count of collectives, FSDP2 on the 2-D mesh, the parameter
server. The runs are the RESULT dicts of scripts/train_pipeline.py, train_tp.py and rpc_param_server.py."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

from ..claims import verify
from ..pipeline import bubble_theory
from ..tensor_parallel import wire_bytes


def _same(on_gpu: bool) -> float:
    """How far two computations of one model may differ: float32 round-off on a CPU; GPUs may compute the split
    and the whole matmuls differently (TF32)."""
    return 1e-3 if on_gpu else 1e-5


def _sends_slack(row: Mapping[str, float]) -> float:
    """How far above the formula a measured bubble may lie: what moving the activations and Python cost, measured
    apart (the step without compute, ``bare_s``), three times over for a busy machine, plus 10 ms."""
    return (3 * row["bare_s"] + 0.01) / row["step_s"]


def check_pipeline(pipe: Mapping, on_gpu: bool) -> None:
    """train_pipeline.py's run: every schedule against the unsplit model, then its timed steps."""
    same, p = _same(on_gpu), pipe["stages"]
    rows = {name: [r for r in pipe["timed"] if r["schedule"] == name] for name in pipe["against_unsplit"]}
    off_order = [(name, r["microbatches"]) for name, rs in rows.items() for r in rs
                 if r["order_theory"] and [[e[0] for e in stage] for stage in r["events"]] != r["order_theory"]]
    off_formula = [(name, r["microbatches"], round(r["bubble"], 3)) for name, rs in rows.items() for r in rs
                   if r["chunks"] == 1 and not -0.02 <= r["bubble"] - bubble_theory(p, r["microbatches"]) <= _sends_slack(r)]
    fewest = min(r["microbatches"] for r in rows["interleaved"])
    inter, plain = (next(r for r in rows[name] if r["microbatches"] == fewest) for name in ("interleaved", "1f1b"))
    verify([
        ("every schedule trained the unsplit model: losses and weights equal up to float32 round-off",
         all(g["loss_diff"] <= same and g["param_diff"] <= same for g in pipe["against_unsplit"].values())),
        ("under every schedule, more micro-batches made a smaller bubble",
         all([r["bubble"] for r in rs] == sorted((r["bubble"] for r in rs), reverse=True) for rs in rows.values())),
        ("each stage ran its forwards and backwards in the order the schedule prescribes (one chunk per rank)",
         not off_order),
        ("GPipe's and 1F1B's bubbles follow (p-1)/(m+p-1), above it by no more than the sends and Python cost",
         not off_formula),
        (f"at the fewest micro-batches ({fewest}), interleaving waited less than 1F1B: {inter['bubble']:.2f} against "
         f"{plain['bubble']:.2f}", inter["bubble"] < plain["bubble"]),
    ], detail=lambda: f"out of order: {off_order}; off the formula (schedule, m, bubble): {off_formula}")


def check_interleaved_run(rows: Sequence[Mapping], stages: int, bubble: Callable[[int, int, int], float]) -> None:
    """Section 2's interleaved steps against ``bubble``, the formula the exercise just checked, as tightly as the
    other schedules were judged against theirs."""
    off = [(r["microbatches"], round(r["bubble"], 3), round(bubble(stages, r["microbatches"], r["chunks"]), 3))
           for r in rows if not -0.02 <= r["bubble"] - bubble(stages, r["microbatches"], r["chunks"]) <= _sends_slack(r)]
    verify([("every interleaved step waited what your formula says, above it by no more than the sends and Python "
             "cost", not off)], detail=lambda: f"(m, measured, formula): {off}")


def check_tensor_parallel(tp: Mapping, on_gpu: bool) -> None:
    """train_tp.py's run: the MLP split by hand and two DTensor plans, against the unsplit blocks."""
    same, t, theory = _same(on_gpu), tp["tp"], tp["theory"]
    megatron = {name: r for name, r in tp["dtensor"].items() if name != "sequence parallel"}
    one, own = tp["dtensor"]["inputs as one DTensor"], tp["dtensor"]["each layer's own input"]
    verify([
        ("split by hand, the MLP computes what the whole one does: output, input and weight gradients",
         max(tp["by_hand"].values()) <= same),
        ("both DTensor plans compute the unsplit blocks' output and input gradient",
         all(r["output_gap"] <= same and r["input_grad_gap"] <= same for r in megatron.values())),
        (f"and trained as they do, each data-parallel group on its share of the batch: {tp['train_loss_gap']:.1e}",
         tp["train_loss_gap"] <= same),
        ("both ran all-reduces and nothing else",
         all(set(r["forward"]) == set(r["backward"]) == {"all_reduce"} for r in megatron.values())),
        (f"with the inputs entering once, Megatron's count: {theory['forward_calls']} forward and "
         f"{theory['backward_calls']} backward, of {theory['forward_bytes']:,} B",
         (one["forward"]["all_reduce"], one["forward_bytes"]["all_reduce"], one["backward"]["all_reduce"],
          one["backward_bytes"]["all_reduce"]) == (theory["forward_calls"], theory["forward_bytes"],
                                                   theory["backward_calls"], theory["backward_bytes"])),
        (f"with each layer converting its own input, more backward all-reduces ({own['backward']['all_reduce']}): each "
         "column-parallel layer all-reduces its own input gradient", own["backward"]["all_reduce"] > theory["backward_calls"]),
        (f"each rank holds about 1/{t} of the weights", one["params_this_rank"] < one["params_whole"] / t * 1.1),
    ])


def check_sequence_parallel(tp: Mapping, on_gpu: bool) -> None:
    """train_tp.py's sequence-parallel plan against the plan whose inputs enter once as a DTensor."""
    sp, one, t, theory = tp["dtensor"]["sequence parallel"], tp["dtensor"]["inputs as one DTensor"], tp["tp"], tp["theory"]
    sent = [sum(wire_bytes(op, n, t) for op, n in r["forward_bytes"].items()) for r in (one, sp)]
    shape = tp["shape"]
    norms = 2 * shape["blocks"] * shape["batch"] * shape["seq"] * shape["hidden"] * 4  # 2 norms a block, fp32
    saved = one["saved_bytes"] - sp["saved_bytes"]
    verify([
        ("the sequence-parallel blocks compute the unsplit ones",
         sp["output_gap"] <= _same(on_gpu) and sp["input_grad_gap"] <= _same(on_gpu)),
        (f"every all-reduce became a reduce-scatter, and each region's input an all-gather: "
         f"{theory['forward_calls']} of each forward",
         sp["forward"] == {"all_gather_into_tensor": theory["forward_calls"],
                           "reduce_scatter_tensor": theory["forward_calls"]}),
        (f"the same bytes on the wire, by the ring's formulas: {sent[1]:,.0f} B", math.isclose(*sent, rel_tol=1e-9)),
        (f"the saved activations fell by {saved:,} B: (t-1)/t of the layer norms' inputs, {(t - 1) / t * norms:,.0f} B",
         abs(saved - (t - 1) / t * norms) <= 0.1 * norms),
    ])


def check_fsdp_tp(two_d: Mapping, on_gpu: bool) -> None:
    """train_tp.py on a 2-D mesh: FSDP2 over dp composed with tensor parallel over tp."""
    f = two_d["fsdp_tp"]
    verify([
        (f"FSDP2 on top of the split trained the unsplit blocks: losses {f['loss_gap']:.1e} apart",
         f["loss_gap"] <= _same(on_gpu)),
        (f"each rank holds about 1/(dp x t) = 1/{two_d['ranks']} of the weights",
         f["params_this_rank"] < f["params_whole"] / two_d["ranks"] * 1.1),
    ])


def check_param_server(server: Mapping, steps: int) -> None:
    """rpc_param_server.py: two trainers, ``steps`` steps each, against rank 0's model."""
    verify([
        (f"the server ran a forward pass for each of both trainers' {steps} steps",
         sorted(server["steps"].values()) == [steps] * 2),
        (f"its model learned from both: held-out loss {server['held_out_loss_before']:.3f} -> "
         f"{server['held_out_loss_after']:.3f}", server["held_out_loss_after"] < 0.7 * server["held_out_loss_before"]),
    ])


def check_transformer_layouts(unsplit: Mapping, layouts: Mapping[str, Mapping], on_gpu: bool) -> None:
    """scripts/train_lm.py's RESULTs: the decoder in one process, and split by each layout (label: RESULT) on the
    same seed and tokens; every loss and gradient norm within round-off of the unsplit run's."""
    rel = 10 * _same(on_gpu)

    def gap(run: Mapping, key: str) -> float:
        return max(abs(a - b) / abs(b) for a, b in zip(run[key], unsplit[key], strict=True))

    claims = [(f"{label} on {run['world_size']} ranks took the unsplit run's {unsplit['tokens_per_step']:,} tokens a "
               f"step and trained its losses and gradient norms, step for step within {rel:g} relative (largest "
               f"gap {max(gap(run, 'losses'), gap(run, 'grad_norms')):.1e})",
               lambda run=run: run["tokens_per_step"] == unsplit["tokens_per_step"]
               and len(run["losses"]) == len(unsplit["losses"])
               and max(gap(run, "losses"), gap(run, "grad_norms")) <= rel)
              for label, run in layouts.items()]
    verify(claims)


def check_ring_traffic(sent: Mapping[str, float], theory: Mapping[str, int], layers: int) -> None:
    """The bytes one rank sent round the ring in a training step (``train_lm.py``'s ``ring_bytes_per_step``,
    counted as it sent them) against :func:`course_utils.parallel.context.ring_bytes` for each attention layer."""
    verify([(f"{phase}: {sent[phase]:,.0f} B a step, {layers} attention layers x the theory's {theory[phase]:,} B",
             sent[phase] == layers * theory[phase]) for phase in ("forward", "backward")])


def check_zigzag_balance(work: Mapping[str, Sequence[int]], computed: Mapping[str, Sequence[int]],
                         theory: Mapping[str, Sequence[int]]) -> None:
    """Per split (``contiguous``, ``zigzag``), per rank: the causal triangle's query-key pairs (``work``), the pairs
    each rank's ring computed per layer in a run (``computed``, counted as it ran), and
    :func:`course_utils.parallel.context.computed_pairs` (``theory``)."""
    contiguous, zigzag = work["contiguous"], work["zigzag"]
    ran = {layout: max(pairs) for layout, pairs in computed.items()}
    verify([
        ("both splits share out the whole causal triangle", sum(contiguous) == sum(zigzag)),
        (f"the contiguous split leaves the last rank {contiguous[-1] / contiguous[0]:.1f} x the first rank's share",
         contiguous[-1] > contiguous[0] and list(contiguous) == sorted(contiguous)),
        ("the zig-zag split gives every rank the same share", len(set(zigzag)) == 1),
        ("each rank's ring computed the pairs the chunk theory counts, under both splits",
         {k: list(v) for k, v in computed.items()} == {k: list(v) for k, v in theory.items()}),
        (f"the busiest rank computed {ran['contiguous'] / ran['zigzag']:.2f} x as many pairs split in order as split "
         "zig-zag: the step waits for it", ran["zigzag"] < ran["contiguous"]),
    ])


def check_expert_load(load: Sequence[int], tokens: int, top_k: int, aux_loss: float) -> None:
    """The router's load per expert on real text, and Switch's balancing loss for it."""
    even = tokens * top_k / len(load)
    verify([
        (f"every token went to {top_k} experts: {sum(load):,} assignments", sum(load) == tokens * top_k),
        ("the load is uneven: the busiest expert took more than its even share, the idlest less",
         max(load) > even > min(load)),
        (f"the balancing loss read it: {aux_loss:.3f}, above 1 (its value where the router's probabilities are "
         "even)", aux_loss > 1.0),
    ])


def imbalance(load: Sequence[int]) -> float:
    """The busiest expert's assignments over the even share: 1.0 when every expert took as many."""
    return max(load) / (sum(load) / len(load))


def check_balancing_loss(plain: Sequence[Sequence[int]], balanced: Sequence[Sequence[int]], last: int) -> None:
    """Two one-process runs of train_lm.py --experts on the same seed and tokens, without and with the
    balancing loss: their routers' assignments per expert each step (``expert_load``)."""
    tail = {name: [sum(col) for col in zip(*loads[-last:])] for name, loads in (("plain", plain), ("balanced", balanced))}
    verify([
        ("at step 1 both routed alike (the same weights: the loss acts through the updates)", plain[0] == balanced[0]),
        ("both routed every step's assignments", [sum(s) for s in plain] == [sum(s) for s in balanced]),
        (f"over the last {last} steps the busiest expert took {imbalance(tail['plain']):.2f} x its even share without "
         f"the loss and {imbalance(tail['balanced']):.2f} x with it", imbalance(tail["balanced"]) < imbalance(tail["plain"])),
    ])


def check_all_to_all_traffic(counted: Mapping[str, float], from_load: float) -> None:
    """The bytes rank 0's dispatch sent to other ranks in a training step (``all_to_all_bytes_per_step``, counted
    from the split sizes it sent with), against :func:`course_utils.parallel.experts.all_to_all_bytes` of what
    its routers chose (``expert_load``)."""
    verify([(f"rank 0's dispatch sent {counted['dispatch']:,.0f} B a step: exactly the rows its routers gave other "
             f"ranks' experts ({from_load:,.0f} B)", abs(counted["dispatch"] - from_load) < 0.5)])


def check_cp_activations(activations: Mapping[int, Sequence[float]], lengths: Sequence[int]) -> None:
    """``train_lm.py``'s ``activation_mib`` (what rank 0 kept for the backward pass of its first step) for each
    context-parallel degree (1 first) at each sequence length: each rank's share of the sequence sets it."""
    one = activations[1]
    claims = [(f"at CP = 1 the activations grow with the sequence: {one[-1] / one[0]:.2f} x from {lengths[0]} to "
               f"{lengths[-1]} tokens ({lengths[-1] // lengths[0]} x as many)",
               0.9 * lengths[-1] / lengths[0] <= one[-1] / one[0] <= 1.1 * lengths[-1] / lengths[0])]
    for cp, mib in activations.items():
        if cp == 1:
            continue
        ratios = [m / o for m, o in zip(mib, one, strict=True)]
        claims.append((f"at CP = {cp} each rank keeps {min(ratios):.2f}-{max(ratios):.2f} of CP = 1's at every length "
                       f"(1/{cp} = {1 / cp:.2f}, plus the ring's own fp32 output and log-sum-exp)",
                       all(1 / cp <= r <= 1.25 / cp for r in ratios)))
    verify(claims)
