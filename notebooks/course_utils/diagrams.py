"""The course's diagrams: each idea drawn before it is measured (schematic, unit times, not measurements).

The ring all-reduce's steps (02), the process trees of srun and srun + torchrun (04), DDP's buckets
overlapping backward (03), a checkpoint-and-restart timeline (05). Charts of measured results live in
:mod:`course_utils.plots`.
"""

from __future__ import annotations

import matplotlib.pyplot as plt

from .plots import PALETTE, _show


def ring_chart(world: int, title: str = ""):
    """The ring all-reduce of ``world`` ranks, step by step: left, the ring (each rank sends to its right neighbour);
    right, the chunk each rank sends at each step, by the rules of collectives.ring_all_reduce (reduce-scatter step
    k: chunk rank - k; all-gather step k: chunk rank + 1 - k)."""
    import math

    colours = plt.get_cmap("tab10")
    fig, (ring, grid) = plt.subplots(1, 2, figsize=(9, 0.42 * 2 * (world - 1) + 2.2),
                                     gridspec_kw={"width_ratios": [1, 1.6]})
    at = [(math.cos(math.pi / 2 - 2 * math.pi * r / world), math.sin(math.pi / 2 - 2 * math.pi * r / world))
          for r in range(world)]
    for r, (x, y) in enumerate(at):
        nx, ny = at[(r + 1) % world]
        ring.annotate("", xy=(0.78 * nx + 0.22 * x, 0.78 * ny + 0.22 * y), xytext=(0.78 * x + 0.22 * nx,
                      0.78 * y + 0.22 * ny), arrowprops={"arrowstyle": "->", "color": "grey"})
        ring.add_patch(plt.Circle((x, y), 0.2, color="#4C72B0"))
        ring.text(x, y, f"rank {r}", ha="center", va="center", color="white", fontsize=8)
    ring.set_xlim(-1.35, 1.35)
    ring.set_ylim(-1.35, 1.35)
    ring.set_aspect("equal")
    ring.axis("off")
    ring.set_title("each rank sends to its right")
    rows = [("reduce-scatter", k, lambda r, k=k: (r - k) % world) for k in range(world - 1)]
    rows += [("all-gather", k, lambda r, k=k: (r + 1 - k) % world) for k in range(world - 1)]
    for i, (phase, k, chunk) in enumerate(rows):
        for r in range(world):
            c = chunk(r)
            grid.add_patch(plt.Rectangle((r, i), 0.92, 0.85, color=colours(c % 10), alpha=0.8 if phase[0] == "r" else 0.45))
            grid.text(r + 0.46, i + 0.42, f"chunk {c}", ha="center", va="center", fontsize=8)
    grid.set_xlim(0, world)
    grid.set_ylim(len(rows), 0)
    grid.set_xticks([r + 0.46 for r in range(world)], [f"rank {r}" for r in range(world)])
    grid.set_yticks([i + 0.42 for i in range(len(rows))], [f"{phase} {k + 1}" for phase, k, _ in rows])
    grid.tick_params(length=0)
    for side in grid.spines.values():
        side.set_visible(False)
    grid.set_title("the chunk each rank sends at each step (dark: its receiver adds it; pale: keeps it)", fontsize=9)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _show()


def launch_trees_chart(nodes: int = 2, gpus: int = 2):
    """The processes of a multi-node job, both ways: ``srun`` starting a task per GPU (each task a rank), and
    ``srun`` starting one ``torchrun`` per node that starts a worker per GPU (each worker a rank)."""
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for ax, agents, title in ((axes[0], False, "srun: a task per GPU"),
                              (axes[1], True, "srun + torchrun: a task per node")):
        width = 1.0 / nodes
        ax.add_patch(plt.Rectangle((0.3, 0.86), 0.4, 0.1, color="#dddddd"))
        ax.text(0.5, 0.91, "batch script (first node): srun", ha="center", va="center", fontsize=8)
        for n in range(nodes):
            x0 = n * width + 0.02
            ax.add_patch(plt.Rectangle((x0, 0.02), width - 0.04, 0.72, fill=False, edgecolor="grey", linestyle="--"))
            ax.text(x0 + 0.01, 0.70, f"node {n}", fontsize=8, va="top", color="grey")
            top = 0.55
            if agents:
                ax.add_patch(plt.Rectangle((x0 + 0.1 * width, 0.45), 0.8 * width - 0.04, 0.12, color="#C44E52"))
                ax.text(x0 + width / 2 - 0.02, 0.51, "torchrun (agent)", ha="center", va="center", fontsize=8,
                        color="white")
                ax.annotate("", xy=(x0 + width / 2 - 0.02, 0.57), xytext=(0.5, 0.86),
                            arrowprops={"arrowstyle": "->", "color": "grey"})
                top = 0.28
            for g in range(gpus):
                w = (width - 0.08) / gpus
                gx = x0 + 0.02 + g * w
                rank = n * gpus + g
                ax.add_patch(plt.Rectangle((gx, top - 0.2), w - 0.02, 0.18, color="#4C72B0"))
                ax.text(gx + (w - 0.02) / 2, top - 0.11, f"python: rank {rank}\nGPU {g}", ha="center", va="center",
                        fontsize=7, color="white")
                source = (x0 + width / 2 - 0.02, 0.45) if agents else (0.5, 0.86)
                ax.annotate("", xy=(gx + (w - 0.02) / 2, top - 0.02), xytext=source,
                            arrowprops={"arrowstyle": "->", "color": "grey", "alpha": 0.6})
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.axis("off")
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    _show()


def bucket_overlap_chart(layers: int = 8, per_bucket: int = 3):
    """DDP's backward, schematically: the layers' gradients computed last layer first, each bucket of
    ``per_bucket`` layers all-reduced as soon as its last gradient is ready, while backward goes on; against one
    bucket for the whole model, whose all-reduce can start only when backward has ended. Unit times, not a
    measurement."""
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.4), sharex=True)
    for ax, buckets, title in ((axes[0], per_bucket, f"buckets of {per_bucket} layers: all-reduce overlaps backward"),
                               (axes[1], layers, "one bucket: the all-reduce waits for the whole backward")):
        free_at = 0.0
        for k in range(layers):  # backward of layer (layers - 1 - k) takes one unit
            layer = layers - 1 - k
            ax.barh(1, 0.95, left=k, color="#4C72B0")
            ax.text(k + 0.47, 1, f"L{layer}", ha="center", va="center", color="white", fontsize=8)
            if (k + 1) % buckets == 0 or k == layers - 1:
                size = (k % buckets) + 1
                start = max(k + 1, free_at)
                ax.barh(0, 0.8 * size - 0.05, left=start, color="#DD8452")
                ax.text(start + 0.4 * size, 0, f"{size} layers", ha="center", va="center", fontsize=8)
                free_at = start + 0.8 * size
        ax.axvline(free_at, color="grey", linestyle="--", linewidth=1)
        ax.set_yticks([1, 0], ["backward", "all-reduce"])
        ax.set_title(title, fontsize=10)
    axes[1].set_xlabel("time (units of one layer's backward; schematic)")
    fig.tight_layout()
    _show()


def checkpoint_timeline_chart(every: int = 5, fail_at: float = 13.0, restart: float = 2.0, total: int = 20):
    """A job that checkpoints every ``every`` steps, killed at ``fail_at``: the steps since its last checkpoint
    are lost, and the restarted job (after ``restart`` units of start-up) goes on from that checkpoint."""
    last = int(fail_at // every) * every
    fig, ax = plt.subplots(figsize=(9, 3.0))
    ax.barh(1, last, left=0, color=PALETTE[0], height=0.5, label="trained, kept")
    ax.barh(1, fail_at - last, left=last, color=PALETTE[3], height=0.5, hatch="//", alpha=0.6,
            label="trained, lost")
    ax.plot([fail_at], [1], marker="X", markersize=14, color="black")
    ax.text(fail_at, 1.35, "a rank dies", ha="center", fontsize=8)
    resume = fail_at + restart
    ax.barh(0, restart, left=fail_at, color="#dddddd", height=0.5, label="restart, load last.pt")
    ax.barh(0, total - last, left=resume, color=PALETTE[0], height=0.5)
    ax.text(resume + 0.2, 0, f"resumes at step {last}", va="center", fontsize=8, color="white")
    for k in range(every, int(resume + total - last) + 1, every):
        if k <= fail_at:
            ax.axvline(k, ymin=0.55, ymax=0.9, color=PALETTE[2], linewidth=2)
    for k in range(last + every, total + 1, every):
        ax.axvline(resume + k - last, ymin=0.1, ymax=0.45, color=PALETTE[2], linewidth=2)
    ax.plot([], [], color=PALETTE[2], linewidth=2, label="checkpoint written")
    ax.set_yticks([1, 0], ["first start", "restarted"])
    ax.set_xlabel("wall time (optimiser steps; schematic)")
    ax.set_ylim(-0.5, 1.7)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.3), fontsize=7, ncol=4, frameon=False)
    ax.set_title(f"checkpoint every {every} steps: a failure at step {fail_at:g} costs the {fail_at - last:g} "
                 "steps since the last one, plus the restart", fontsize=10)
    fig.tight_layout()
    _show()


def zero_stages_chart(ranks: int = 4):
    """What each rank holds per parameter under DDP and ZeRO-1, -2, -3, for mixed-precision Adam (Rajbhandari et
    al., 2020): 2 bytes of bf16 weights, 2 of gradients, 12 of fp32 optimizer state (master weights, momentum,
    variance). A part a stage shards is drawn 1/``ranks`` as long: each rank keeps its own slice."""
    parts = (("weights (2)", 2.0, PALETTE[0]), ("gradients (2)", 2.0, PALETTE[1]),
             ("optimizer state (12)", 12.0, PALETTE[2]))
    stages = (("DDP (stage 0)", 0), ("ZeRO-1", 1), ("ZeRO-2", 2), ("ZeRO-3", 3))
    fig, ax = plt.subplots(figsize=(9, 2.8))
    for row, (name, stage) in enumerate(stages):
        left = 0.0
        for k, (label, size, colour) in enumerate(parts):
            sharded = {0: stage >= 3, 1: stage >= 2, 2: stage >= 1}[k]
            width = size / ranks if sharded else size
            ax.barh(row, width, left=left, color=colour, hatch="//" if sharded else None, edgecolor="white",
                    label=label if row == 0 else None)
            left += width
        ax.text(left + 0.2, row, f"{left:g} bytes per parameter", va="center", fontsize=8)
    ax.set_yticks(range(len(stages)), [s[0] for s in stages])
    ax.invert_yaxis()
    ax.set_xlim(0, 19)
    ax.set_xlabel(f"bytes per parameter on each of {ranks} ranks (hatched: sharded, 1/{ranks} each)")
    ax.legend(loc="lower right", fontsize=8)
    ax.set_title("what each ZeRO stage shards (mixed-precision Adam)", fontsize=10)
    fig.tight_layout()
    _show()


def column_row_chart(ranks: int = 2):
    """Megatron's split of an MLP over ``ranks`` ranks: the first matrix A by columns, the second B by rows. Each
    rank computes X·A_r, then (X·A_r)·B_r, a partial sum of the output; one all-reduce adds them."""
    colours = plt.get_cmap("tab10")
    fig, ax = plt.subplots(figsize=(10, 2.8))

    def block(x, y, w, h, text, colour="#dddddd", alpha=1.0):
        ax.add_patch(plt.Rectangle((x, y), w, h, facecolor=colour, edgecolor="black", alpha=alpha))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8)

    block(0.0, 0.3, 0.8, 1.4, "X\n(every rank)")
    for r in range(ranks):  # A's columns
        block(1.2 + r * 0.7, 0.3, 0.7, 1.4, f"A cols\nrank {r}", colours(r), 0.6)
    ax.text(1.2 + ranks * 0.35, 1.85, "A split by columns", ha="center", fontsize=9)
    x0 = 1.6 + ranks * 0.7
    for r in range(ranks):  # B's rows
        block(x0, 1.7 - (r + 1) * 1.4 / ranks, 1.4, 1.4 / ranks, f"B rows, rank {r}", colours(r), 0.6)
    ax.text(x0 + 0.7, 1.85, "B split by rows", ha="center", fontsize=9)
    x1 = x0 + 1.8
    for r in range(ranks):
        block(x1, 1.7 - (r + 1) * 1.4 / ranks, 1.6, 1.4 / ranks - 0.05, f"rank {r}: GeLU(X·A_r)·B_r", colours(r), 0.6)
    ax.annotate("", xy=(x1 + 2.1, 1.0), xytext=(x1 + 1.65, 1.0), arrowprops={"arrowstyle": "->"})
    block(x1 + 2.15, 0.6, 1.3, 0.8, "all-reduce:\nsum = GeLU(X·A)·B")
    ax.text(x1 + 0.8, 0.05, "no communication until here", ha="center", fontsize=8, color="grey")
    ax.set_xlim(-0.1, x1 + 3.6)
    ax.set_ylim(0, 2.1)
    ax.axis("off")
    ax.set_title(f"a tensor-parallel MLP on {ranks} ranks: one all-reduce forward (and one backward)", fontsize=10)
    fig.tight_layout()
    _show()


def ring_attention_chart(ranks: int = 4, seq: int = 64):
    """Ring attention, step by step, for a contiguous and a zig-zag split of ``seq`` tokens: the key/value block
    each rank holds at each step (step s: the block of rank - s), and the share of its query-key pairs a causal
    mask leaves to compute (pale: none, the block skipped)."""
    from .parallel.context import positions

    colours = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 2, figsize=(10, 0.5 * ranks + 1.8))
    for ax, layout in zip(axes, ("contiguous", "zigzag"), strict=True):
        for step in range(ranks):
            for rank in range(ranks):
                owner = (rank - step) % ranks
                q, k = positions(layout, rank, ranks, seq), positions(layout, owner, ranks, seq)
                share = (k[None, :] <= q[:, None]).float().mean().item()  # the causal mask's visible pairs
                ax.add_patch(plt.Rectangle((step, rank), 0.92, 0.85, color=colours(owner % 10),
                                           alpha=0.15 + 0.75 * share))
                ax.text(step + 0.46, rank + 0.42, f"K,V of {owner}\n{share:.0%}", ha="center", va="center",
                        fontsize=7)
        ax.set_xlim(0, ranks)
        ax.set_ylim(ranks, 0)
        ax.set_xticks([s + 0.46 for s in range(ranks)], [f"step {s + 1}" for s in range(ranks)])
        ax.set_yticks([r + 0.42 for r in range(ranks)], [f"rank {r}" for r in range(ranks)])
        ax.tick_params(length=0)
        for side in ax.spines.values():
            side.set_visible(False)
        ax.set_title(f"{layout} split", fontsize=9)
    fig.suptitle("ring attention: the K,V block each rank holds at each step, and the share a causal mask computes",
                 fontsize=9)
    fig.tight_layout()
    _show()
