"""The single-device speed-up ladder of notebook 01 and ``scripts/benchmark_single.py``.

Each rung adds one technique on top of the best configuration so far and
measures images/s side by side in one process. A rung is *kept* only if it
made this machine faster, so the last kept rung is the best configuration
found here; rungs that need a GPU (or Ampere tensor cores) are skipped with
the reason printed, which is how the same notebook teaches on a laptop CPU.
"""

from __future__ import annotations

import gc
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .config import TrainConfig, changes, config_flags
from .data import get_datasets, make_loader
from .process_group import choose_device
from .precision import cpu_bf16_here, precision_for
from .models import build_model
from .trainer import Trainer


@dataclass
class LadderSettings:
    model: str = "resnet18"
    batch_size: int = 256
    steps: int = 30  # timed steps per rung
    untimed_steps: int = 5  # steps per rung before the clock starts (compile, autotuning, worker start)
    workers: int = 8  # the value the "workers" rung switches to
    device: str = "auto"
    compile_on_cpu: bool = False  # the ladder on a CPU skips torch.compile unless asked
    seed: int = 0

    def textbook(self) -> TrainConfig:
        """The first rung: the fp32 loop with PyTorch's defaults, data loaded in the main process."""
        return TrainConfig(model=self.model, batch_size=self.batch_size, seed=self.seed, device=self.device,
                           workers=0, epochs=1, steps_per_epoch=self.untimed_steps + self.steps,
                           untimed_steps=self.untimed_steps, progress=False, log_every=10**9)


@dataclass
class RungResult:
    rung: str
    status: str  # kept | dropped (slower here) | dropped (within noise) | skipped: <why>
    images_per_s: float = float("nan")
    speedup: float = float("nan")  # versus the fp32 baseline
    data_fraction: float = float("nan")
    untimed_s: float = float("nan")  # the untimed first steps: where torch.compile and autotuning pay
    changes: dict[str, Any] = field(default_factory=dict)  # TrainConfig fields changed from the textbook rung


RUNG_FIELDS = ("workers", "pin_memory", "cudnn_benchmark", "tf32", "channels_last", "precision", "compile")
"""The :class:`TrainConfig` fields the rungs turn."""


def _gpu_cc(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else (0, 0)


def rungs(device: torch.device, settings: LadderSettings) -> list[tuple[str, dict[str, Any], str | None]]:
    """``(name, TrainConfig change, reason_to_skip)`` for each rung on ``device``."""
    gpu = device.type == "cuda"
    no_gpu = None if gpu else "needs a GPU"
    ampere = None if _gpu_cc(device) >= (8, 0) else "needs an Ampere or newer GPU"
    amp = precision_for("amp", device.type, _gpu_cc(device), cpu_bf16=cpu_bf16_here())  # bf16/fp16; a CPU: bf16/fp32
    compile_skip = None
    if not gpu and not settings.compile_on_cpu:
        compile_skip = "off on CPU unless compile_on_cpu is set (the compile time is paid in the untimed steps)"
    return [
        ("fp32 textbook (defaults)", {}, None),
        (f"+ {settings.workers} DataLoader workers", {"workers": settings.workers}, None),
        ("+ pinned memory", {"pin_memory": True}, no_gpu),
        ("+ cudnn.benchmark", {"cudnn_benchmark": True}, no_gpu),
        ("+ TF32", {"tf32": True}, ampere if gpu else no_gpu),
        ("+ channels_last", {"channels_last": True}, None),
        ("+ AMP (" + amp + ")", {"precision": "amp"},
         "this CPU has no bf16 instructions: amp is fp32 here" if amp == "fp32" else None),
        ("+ torch.compile", {"compile": True}, compile_skip),
    ]


def measure(
    cfg: TrainConfig,
    train_ds: torch.utils.data.Dataset,
    in_channels: int,
    device: torch.device,
    step_callback: Callable[[], None] | None = None,
) -> dict[str, float]:
    """Train ``cfg.steps_per_epoch`` steps of ``cfg``; images/s over the timed ones."""
    torch.manual_seed(cfg.seed)
    model = build_model(cfg.model, in_channels)
    loader = make_loader(
        train_ds, cfg.batch_size, shuffle=True, workers=cfg.workers,
        pin_memory=cfg.pin_memory, drop_last=True, seed=cfg.seed,
    )
    trainer = Trainer(model, loader, device, cfg)
    trainer.step_callback = step_callback
    try:
        _, meter = trainer.train_epoch()
    finally:
        del trainer, model, loader
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        if cfg.compile:
            torch._dynamo.reset()
    return meter.summary()


def ladder_dataset(settings: LadderSettings) -> tuple[torch.utils.data.Dataset, int]:
    """Enough synthetic images for one rung (no download; augmentation on, as in training)."""
    n = settings.batch_size * (settings.steps + settings.untimed_steps)
    train, _, info = get_datasets("synthetic", n_train=n, n_val=1, augment=True, seed=settings.seed)
    return train, info.channels


def run_ladder(settings: LadderSettings, margin: float = 0.0, echo: Callable[[str], None] = print) -> list[RungResult]:
    """Climb the ladder; returns one :class:`RungResult` per rung. A rung is kept when it is faster than the best
    configuration before it by at least ``margin`` (a share: the run-to-run noise :func:`repeat_spread` measures)."""
    device = choose_device(settings.device)
    train_ds, channels = ladder_dataset(settings)
    textbook = settings.textbook()
    best, best_ips, baseline = textbook, 0.0, 0.0
    results: list[RungResult] = []
    for name, change, skip in rungs(device, settings):
        if skip:
            results.append(RungResult(name, f"skipped: {skip}"))
            echo(f"{name:28s} skipped: {skip}")
            continue
        cfg = replace(best, **change)
        summary = measure(cfg, train_ds, channels, device)
        ips = summary["images_per_s"]
        if not baseline:
            baseline = ips
        kept = ips >= best_ips * (1 + margin)
        status = "kept" if kept else "dropped (within noise)" if ips >= best_ips else "dropped (slower here)"
        if kept:
            best, best_ips = cfg, ips
        results.append(
            RungResult(name, status, ips, ips / baseline, summary["data_fraction"], summary["untimed_s"],
                       changes(cfg, textbook))
        )
        data_pct = 100 * summary["data_fraction"]
        echo(f"{name:28s} {ips:10,.0f} img/s  x{ips / baseline:5.2f}  data {data_pct:3.0f}%  {status}")
    return results


def repeat_spread(settings: LadderSettings, repeats: int = 3) -> list[float]:
    """images/s of the first rung measured ``repeats`` times: the run-to-run noise a difference
    between rungs has to beat before it means anything."""
    device = choose_device(settings.device)
    train_ds, channels = ladder_dataset(settings)
    return [measure(settings.textbook(), train_ds, channels, device)["images_per_s"] for _ in range(repeats)]


def workers_sweep(
    settings: LadderSettings, workers: list[int], echo: Callable[[str], None] = print
) -> list[dict[str, float]]:
    """images/s and the share of time spent waiting for data, per worker count."""
    device = choose_device(settings.device)
    train_ds, channels = ladder_dataset(settings)
    rows = []
    for w in workers:
        s = measure(replace(settings.textbook(), workers=w), train_ds, channels, device)
        rows.append({"workers": w, **s})
        echo(f"workers={w:2d}  {s['images_per_s']:10,.0f} img/s  waiting for data {100 * s['data_fraction']:3.0f}%")
    return rows


def ladder_table(results: list[RungResult]) -> str:
    rows = [f"{'rung':28s} {'img/s':>10s} {'speed-up':>8s} {'data%':>6s}  status"]
    for r in results:
        if r.status.startswith("skipped"):
            rows.append(f"{r.rung:28s} {'-':>10s} {'-':>8s} {'-':>6s}  {r.status}")
        else:
            rows.append(
                f"{r.rung:28s} {r.images_per_s:10,.0f} {r.speedup:7.2f}x {100 * r.data_fraction:5.0f}%  {r.status}"
            )
    return "\n".join(rows)


def best_speedup(results: list[RungResult]) -> float:
    """Speed-up of the best configuration found (the last kept rung)."""
    kept = [r.speedup for r in results if r.status == "kept"]
    return max(kept) if kept else float("nan")


def profile_steps(
    settings: LadderSettings, cfg: TrainConfig, out_dir: str | Path, active: int = 3
) -> tuple[Path, str]:
    """Record ``active`` training steps with ``torch.profiler``.

    The trace (``*.pt.trace.json``) opens in Perfetto (ui.perfetto.dev) or Chrome's
    chrome://tracing (TensorBoard's profiler plugin is deprecated: pytorch/kineto#1248).
    Returns its path and the top operators.
    """
    from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = choose_device(settings.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    train_ds, channels = ladder_dataset(settings)
    short = replace(cfg, untimed_steps=0, steps_per_epoch=2 + active)
    with profile(
        activities=activities,
        schedule=schedule(wait=1, warmup=1, active=active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(out_dir)),
        record_shapes=False,
    ) as prof:
        measure(short, train_ds, channels, device, step_callback=prof.step)
    sort = "device_time_total" if device.type == "cuda" else "cpu_time_total"
    table = prof.key_averages().table(sort_by=sort, row_limit=12)
    traces = sorted(out_dir.glob("*.pt.trace.json*"), key=lambda p: p.stat().st_mtime)
    if not traces:
        raise RuntimeError(f"the profiler wrote no trace into {out_dir}")
    return traces[-1], table


def train_flops_per_image(model_name: str, channels: int = 3, size: int = 32, classes: int = 10) -> float:
    """Floating-point operations of one training step (forward + backward) per image,
    counted by ``torch.utils.flop_counter`` on a batch of two on the CPU."""
    from torch.utils.flop_counter import FlopCounterMode

    model = build_model(model_name, channels, classes)
    x, y = torch.randn(2, channels, size, size), torch.randint(0, classes, (2,))
    with FlopCounterMode(display=False) as counter:
        torch.nn.functional.cross_entropy(model(x), y).backward()
    return counter.get_total_flops() / 2


def train_flags(cfg: TrainConfig) -> list[str]:
    """The rungs' settings of ``cfg`` as ``scripts/train.py`` flags (the rest stays train.py's default)."""
    return config_flags(replace(TrainConfig(), **{name: getattr(cfg, name) for name in RUNG_FIELDS}))


def best_config(results: list[RungResult], settings: LadderSettings) -> TrainConfig:
    """The configuration of the last kept rung (for ``scripts/train.py``: :func:`course_utils.config.config_flags`)."""
    kept = [r for r in results if r.status == "kept"]
    return replace(settings.textbook(), **(kept[-1].changes if kept else {}))
