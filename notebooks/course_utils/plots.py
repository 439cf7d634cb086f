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
                log: bool = True, annotate: str = "{:,.0f}", legend: str = "lower right"):
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
    ax.legend(loc=legend, fontsize=8)  # where the bars leave room
    fig.tight_layout()
    _show()


def bar_panels(groups: Sequence[str], series: dict[str, Sequence[float]], title: str, annotate: str = "{:,.1f}"):
    """One panel per series (name -> a value per group), each on its own linear axis: for quantities in
    different units (MiB beside ms) that one axis would mix."""
    fig, axes = plt.subplots(1, len(series), figsize=(3.6 * len(series), 0.45 * len(groups) + 1.6), sharey=True)
    for k, (ax, (name, values)) in enumerate(zip(axes, series.items())):
        ax.barh(range(len(groups)), values, color=PALETTE[k % len(PALETTE)])
        for i, v in enumerate(values):
            ax.text(v, i, " " + annotate.format(v), va="center", fontsize=8)
        ax.set_xlabel(name)
        ax.set_xlim(0, 1.25 * max(values))  # room for the labels
    axes[0].set_yticks(range(len(groups)), groups)
    axes[0].invert_yaxis()
    fig.suptitle(title, fontsize=10)
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
               title: str, logx: bool = False, logy: bool = False, steps: bool = False,
               integer_x: bool = False, reference: tuple[float, str] | None = None):
    """One line per series over ``x``; a series given as ``(xs, ys)`` has its own x (then ``x`` may be None).
    ``steps``: hold each value until the next (a best-so-far, a setting that changes at points); ``integer_x``:
    ticks at whole numbers only (workers, ranks); ``reference``: a dashed horizontal line (value, label)."""
    fig, ax = plt.subplots(figsize=(6, 3.6))
    for name, ys in series.items():
        xs, ys = ys if isinstance(ys, tuple) else (x, ys)
        ax.plot(xs, ys, marker="o", label=name, drawstyle="steps-post" if steps else "default")
    if reference is not None:
        ax.axhline(reference[0], color="grey", linestyle="--", linewidth=1, label=reference[1])
        ax.set_ylim(top=max(ax.get_ylim()[1], 1.08 * reference[0]))
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if logx:
        ax.set_xscale("log", base=2)
    if logy:
        ax.set_yscale("log")
    if len(series) > 1 or reference is not None:
        ax.legend(fontsize=8)
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


def shard_deal_chart(deals: dict[str, Sequence], workers: int, title: str = ""):
    """How shards are dealt to ranks x workers, one panel per epoch: ``deals[label]`` holds one
    :class:`~course_utils.data.shards.ShardDataset` per rank, its epoch set. The epoch's shards lie end to end
    in the order that epoch shuffled them (grey boundaries); each reader's bar covers the samples it reads."""
    fig, axes = plt.subplots(len(deals), 1, figsize=(9, (0.32 * workers * len(next(iter(deals.values()))) + 0.9)
                                                     * len(deals)), squeeze=False)
    for ax, (label, ranks) in zip(axes[:, 0], deals.items()):
        sizes = {s["name"]: s["samples"] for s in ranks[0].manifest["shards"]}
        offset, start = {}, 0
        for k, name in enumerate(ranks[0].shard_order()):
            offset[name] = start
            ax.axvspan(start, start + sizes[name], color="#eeeeee" if k % 2 else "#ffffff", zorder=0)
            ax.text(start + sizes[name] / 2, -0.9, name.split(".")[0], ha="center", fontsize=7, color="grey")
            start += sizes[name]
        rows = []
        for rank, ds in enumerate(ranks):
            for w in range(workers):
                for name, first, stop in ds.plan(w, workers):
                    ax.barh(len(rows), stop - first, left=offset[name] + first, color=PALETTE[rank % len(PALETTE)],
                            alpha=0.9 - 0.3 * w, edgecolor="white")
                rows.append(f"rank {rank}, worker {w}")
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.set_ylim(len(rows) - 0.5, -1.3)  # top to bottom, with the shards' names above the first row
        ax.set_xlim(0, start)
        ax.set_title(label, fontsize=9)
    axes[-1, 0].set_xlabel("samples of the epoch, shard after shard (shaded: one shard)")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    _show()


def flight_record_chart(records: dict[int, list[dict]], title: str):
    """Who waits for whom, from the ranks' flight records (``flight_records.read_flight_records``): a row per rank,
    a box per collective by its sequence number, up to the last any rank entered: entered by every rank (blue),
    entered by this rank while another never entered it (orange: waiting), or never entered (an empty red box)."""
    last = max((e["seq"] for entries in records.values() for e in entries), default=0)
    first = max(1, last - 7)
    seqs = {rank: {e["seq"]: e for e in entries} for rank, entries in records.items()}
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(records) + 1.4))
    for row, rank in enumerate(records):
        for seq in range(first, last + 1):
            e = seqs[rank].get(seq)
            if e is None:
                ax.add_patch(plt.Rectangle((seq - 0.4, row - 0.3), 0.8, 0.6, fill=False, edgecolor=PALETTE[3], lw=2))
                ax.text(seq, row, "never\nentered", ha="center", va="center", fontsize=7, color=PALETTE[3])
                continue
            everyone = all(seq in mine or seq < min(mine, default=seq) for mine in seqs.values())
            ax.add_patch(plt.Rectangle((seq - 0.4, row - 0.3), 0.8, 0.6, color=PALETTE[0] if everyone else PALETTE[1]))
            ax.text(seq, row, e["op"].replace("_", "\n", 1) if everyone else "waiting", ha="center", va="center",
                    fontsize=7, color="white")
    ax.set_xlim(first - 0.6, last + 0.6)
    ax.set_ylim(len(records) - 0.4, -0.6)
    ax.set_xticks(range(first, last + 1), [f"#{s}" for s in range(first, last + 1)])
    ax.set_yticks(range(len(records)), [f"rank {r}" for r in records])
    ax.set_xlabel("collective, by its sequence number in the group")
    ax.set_title(title)
    fig.tight_layout()
    _show()


def trace_timeline_chart(timeline: dict[int, dict[str, list[tuple[float, float]]]], title: str):
    """One profiled step of every rank (``traces.step_timeline``): a row of compute and, under it, a row of
    communication; where the two rows overlap in time, the communication was hidden, and a gap in both is idle."""
    rows = [(rank, kind) for rank in timeline for kind in ("compute", "communication")]
    fig, ax = plt.subplots(figsize=(8, 0.45 * len(rows) + 1.3))
    for y, (rank, kind) in enumerate(rows):
        spans = [(s, e - s) for s, e in timeline[rank][kind]]
        ax.broken_barh(spans, (y - 0.35, 0.7), color=PALETTE[0] if kind == "compute" else PALETTE[1])
    ax.set_yticks(range(len(rows)), [f"rank {r} {k}" for r, k in rows])
    ax.invert_yaxis()
    ax.set_xlabel("milliseconds from the step's start")
    ax.set_title(title)
    fig.tight_layout()
    _show()
