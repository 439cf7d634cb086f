"""The course's figures: small helpers so notebooks show a plot in one line."""

from __future__ import annotations

from collections.abc import Sequence

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator


PALETTE = ("#4C72B0", "#DD8452", "#55A868", "#C44E52", "#8172B3")


def _show() -> None:
    """Show the figure now, once, and close it. The helpers return nothing: a returned Figure is shown a second time
    where a cell's trailing `;` does not silence it (nbval runs cells with store_history=False, and make site renders
    those copies)."""
    plt.show()


def bar_chart(labels: Sequence[str], values: Sequence[float], ylabel: str, title: str,
              annotate: str = "{:,.0f}", baseline: float | None = None):
    """Horizontal bars (long labels stay readable); ``baseline`` draws a reference line."""
    fig, ax = plt.subplots(figsize=(7, 0.45 * len(labels) + 1.2))
    y = range(len(labels))
    ax.barh(y, values, color="#4C72B0")
    ax.set_yticks(list(y), labels)
    ax.invert_yaxis()
    ax.set_xlabel(ylabel)
    ax.set_title(title)
    if baseline is not None:
        ax.axvline(baseline, color="grey", linestyle="--", linewidth=1)
    for i, v in enumerate(values):
        if v == v:  # skip NaN
            ax.text(v, i, " " + annotate.format(v), va="center", fontsize=9)
    fig.tight_layout()
    _show()


def paired_bars(groups: Sequence[str], series: dict[str, Sequence[float]], xlabel: str, title: str,
                log: bool = True, annotate: str = "{:,.0f}"):
    """Horizontal bars, one colour per series, side by side within each group; a log axis by default,
    so that a bar 100 times shorter than its neighbour is still seen."""
    fig, ax = plt.subplots(figsize=(7, 0.3 * len(groups) * len(series) + 1.4))
    height = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        y = [i + (k - (len(series) - 1) / 2) * height for i in range(len(groups))]
        ax.barh(y, values, height=height, label=name, color=PALETTE[k % len(PALETTE)])
        for yi, v in zip(y, values):
            ax.text(v, yi, " " + annotate.format(v), va="center", fontsize=8)
    ax.set_yticks(range(len(groups)), groups)
    ax.invert_yaxis()
    if log:
        ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    _show()


def stacked_bars(labels: Sequence[str], parts: dict[str, Sequence[float]], ylabel: str, title: str,
                 marks: Sequence[float] | None = None, mark_label: str = "theory"):
    """One bar per label, stacked from ``parts`` (name -> a value per label); ``marks`` draws a
    tick per bar (what the theory predicts for the whole bar)."""
    fig, ax = plt.subplots(figsize=(7, 3.8))
    x = list(range(len(labels)))
    bottom = [0.0] * len(labels)
    for name, values in parts.items():
        ax.bar(x, values, bottom=bottom, label=name, width=0.6)
        bottom = [b + v for b, v in zip(bottom, values)]
    if marks is not None:
        ax.scatter(x, marks, marker="_", s=900, color="black", linewidths=2, label=mark_label, zorder=3)
    ax.set_xticks(x, labels)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.legend(fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _show()


def line_chart(x: Sequence[float] | None, series: dict[str, Sequence], xlabel: str, ylabel: str,
               title: str, logx: bool = False, logy: bool = False, steps: bool = False):
    """One line per series over ``x``; a series given as ``(xs, ys)`` has its own x (then ``x`` may be None).
    ``steps``: hold each value until the next (a best-so-far, a setting that changes at points)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, ys in series.items():
        xs, ys = ys if isinstance(ys, tuple) else (x, ys)
        ax.plot(xs, ys, marker="o", label=name, drawstyle="steps-post" if steps else "default")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if len(series) > 1:
        ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    _show()


def schedule_chart(events: Sequence[Sequence[tuple[str, float, float]]], title: str):
    """A pipeline step as it ran: a row per stage, a box per pass (``events[stage]``: ``("F3", start, end)``,
    micro-batch 3's forward), forwards light and backwards dark; the white between them is the bubble."""
    fig, ax = plt.subplots(figsize=(8, 0.55 * len(events) + 1.3))
    for stage, passes in enumerate(events):
        for name, start, end in passes:
            forward = name.startswith("F")
            ax.barh(stage, end - start, left=start, height=0.7, color="#9ecae1" if forward else "#3182bd",
                    edgecolor="white")
            ax.text((start + end) / 2, stage, name[1:], ha="center", va="center", fontsize=8,
                    color="black" if forward else "white")
    ax.set_yticks(range(len(events)), [f"stage {s}" for s in range(len(events))])
    ax.invert_yaxis()
    ax.set_xlabel("seconds from the step's start (light: forward, dark: backward; the number: micro-batch)")
    ax.set_title(title)
    fig.tight_layout()
    _show()


def loss_curves(history, step_losses: Sequence[float] = (), title: str = "training"):
    """Left: the loss at each logged step. Right: per-epoch losses and validation accuracy."""
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.4))
    left.plot(range(1, len(step_losses) + 1), step_losses, color="#4C72B0")
    left.set_xlabel("logged step")
    left.set_ylabel("training loss")
    epochs = [h.epoch for h in history]
    right.plot(epochs, [h.train_loss for h in history], marker="o", label="train loss")
    right.plot(epochs, [h.val_loss for h in history], marker="s", label="validation loss")
    right.plot(epochs, [h.val_acc for h in history], marker="^", label="validation accuracy")
    right.set_xlabel("epoch")
    right.xaxis.set_major_locator(MaxNLocator(integer=True))
    right.legend()
    for ax in (left, right):
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    _show()


def trial_curves(searches: dict[str, list[dict]], metric: str = "val_loss", title: str = ""):
    """One panel per search: each trial's ``metric`` by epoch (course_utils.tuning.trials rows); trials
    stopped early in grey, the best trial in red."""
    fig, axes = plt.subplots(1, len(searches), figsize=(5.5 * len(searches), 3.6), sharey=True, squeeze=False)
    for ax, (name, rows) in zip(axes[0], searches.items()):
        for i, row in enumerate(rows):  # rows come best first
            epochs = range(1, len(row[metric]) + 1)
            style = ({"color": "tab:red", "linewidth": 2.2, "label": "best", "zorder": 3} if i == 0 else
                     {"color": "grey", "alpha": 0.6, "linestyle": "--"} if row["status"] == "stopped early" else
                     {"color": "tab:blue", "alpha": 0.7})
            ax.plot(epochs, row[metric], marker="o", markersize=3, **style)
        ax.set_title(name)
        ax.set_xlabel("epoch")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(metric)
    axes[0][0].legend(loc="upper right")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    _show()


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
