"""Honest clocks for GPU code.

CUDA kernels run asynchronously: ``time.perf_counter()`` after ``loss.backward()``
measures how fast Python queued the work, not how fast the GPU did it. Every
reading here synchronises the device first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait until the device has finished its queued work (no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


@dataclass
class Throughput:
    """Images per second, with the time split between waiting for data and computing.

    Call :meth:`data_ready` when a batch arrives and :meth:`step_done` after
    the optimiser step; the first ``warmup`` steps (cuDNN autotuning,
    ``torch.compile``, worker start-up) are not counted.
    """

    device: torch.device | str = "cpu"
    warmup: int = 2
    steps: int = 0
    samples: int = 0
    data_time: float = 0.0
    compute_time: float = 0.0
    _t_last: float = field(default=0.0, repr=False)
    _t_data: float = field(default=0.0, repr=False)
    _seen: int = field(default=0, repr=False)

    def start(self) -> None:
        sync(self.device)
        self._t_last = time.perf_counter()

    def data_ready(self) -> None:
        self._t_data = time.perf_counter()

    def step_done(self, batch_size: int) -> None:
        sync(self.device)
        now = time.perf_counter()
        self._seen += 1
        if self._seen > self.warmup:
            self.steps += 1
            self.samples += batch_size
            self.data_time += self._t_data - self._t_last
            self.compute_time += now - self._t_data
        self._t_last = now

    @property
    def elapsed(self) -> float:
        return self.data_time + self.compute_time

    @property
    def images_per_s(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 else float("nan")

    @property
    def data_fraction(self) -> float:
        return self.data_time / self.elapsed if self.elapsed > 0 else float("nan")

    def summary(self) -> dict[str, float]:
        return {
            "images_per_s": self.images_per_s,
            "data_s": self.data_time,
            "compute_s": self.compute_time,
            "data_fraction": self.data_fraction,
            "steps": float(self.steps),
        }
