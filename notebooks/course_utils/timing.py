"""Honest clocks for GPU code.

CUDA kernels run asynchronously: ``time.perf_counter()`` after ``loss.backward()``
measures how fast Python queued the work, not how fast the GPU did it. A
timed window therefore synchronises the device where it opens and where it
closes, and nowhere in between.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch


def sync(device: torch.device | str | None = None) -> None:
    """Wait until the device has finished its queued work (no-op on CPU)."""
    dev = torch.device(device) if device is not None else None
    if dev is not None and dev.type == "cuda" and torch.cuda.is_available():
        torch.cuda.synchronize(dev)


@dataclass
class Throughput:
    """Images per second over a timed window, and the share of it spent waiting for data.

    Call :meth:`start` before the loop, :meth:`data_ready` when a batch
    arrives, :meth:`step_done` after the optimiser step and :meth:`stop`
    after the loop. The first ``untimed_steps`` (cuDNN autotuning,
    ``torch.compile``, worker start-up) are not counted.

    The GPU is synchronised only where the window opens and where it closes:
    a synchronise after every step would stop the next batch's loading and
    kernel launches from overlapping the GPU's work, and measure a slower loop
    than the one that trains. Waiting for data is the time the training loop
    spent blocked on the DataLoader inside the window.
    """

    device: torch.device | str = "cpu"
    untimed_steps: int = 2
    steps: int = 0
    samples: int = 0
    data_time: float = 0.0
    untimed_s: float = float("nan")  # wall time of the untimed steps: the price of compiling and autotuning
    _t_last: float = field(default=0.0, repr=False)
    _t_start: float = field(default=0.0, repr=False)
    _t_open: float | None = field(default=None, repr=False)
    _t_close: float | None = field(default=None, repr=False)
    _seen: int = field(default=0, repr=False)
    clock: Callable[[], float] = field(default=time.perf_counter, repr=False)  # a test gives its own

    def _open(self) -> None:
        sync(self.device)
        self._t_open = self.clock()
        self.untimed_s = self._t_open - self._t_start

    def start(self) -> None:
        self._t_start = self.clock()
        if self.untimed_steps == 0:
            self._open()
        self._t_last = self.clock()

    def data_ready(self) -> None:
        if self._t_open is not None:
            self.data_time += self.clock() - self._t_last

    def step_done(self, batch_size: int) -> None:
        self._seen += 1
        if self._t_open is not None:
            self.steps += 1
            self.samples += batch_size
        elif self._seen == self.untimed_steps:
            self._open()
        self._t_last = self.clock()

    def stop(self) -> None:
        """Close the window: wait for the GPU to finish the steps it was given."""
        if self._t_open is not None:
            sync(self.device)
            self._t_close = self.clock()

    @property
    def elapsed(self) -> float:
        if self._t_open is None or self._t_close is None:
            return 0.0
        return self._t_close - self._t_open

    @property
    def compute_time(self) -> float:
        return max(0.0, self.elapsed - self.data_time)

    @property
    def images_per_s(self) -> float:
        return self.samples / self.elapsed if self.elapsed > 0 and self.samples else float("nan")

    @property
    def data_fraction(self) -> float:
        return self.data_time / self.elapsed if self.elapsed > 0 and self.samples else float("nan")

    def summary(self) -> dict[str, float]:
        return {
            "images_per_s": self.images_per_s,
            "data_s": self.data_time,
            "compute_s": self.compute_time,
            "data_fraction": self.data_fraction,
            "steps": float(self.steps),
            "untimed_s": self.untimed_s,
        }
