"""The throughput meter: a timed window that synchronises the GPU only where it opens and closes."""

from __future__ import annotations

import pytest

from course_utils import timing


class Clock:
    """A clock the test moves: each step takes exactly what the test says, however busy the machine."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def run_loop(meter: timing.Throughput, steps: int, data_wait: float, compute: float, batch: int = 8) -> None:
    clock = meter.clock if isinstance(meter.clock, Clock) else None
    wait = clock.sleep if clock else (lambda s: None)
    meter.start()
    for _ in range(steps):
        wait(data_wait)  # the DataLoader
        meter.data_ready()
        wait(compute)  # forward, backward, step
        meter.step_done(batch)
    meter.stop()


def test_untimed_steps_are_not_counted_and_the_split_is_measured():
    meter = timing.Throughput("cpu", untimed_steps=2, clock=Clock())
    run_loop(meter, steps=6, data_wait=0.01, compute=0.03)
    assert meter.steps == 4 and meter.samples == 32
    assert meter.data_fraction == pytest.approx(0.25)  # 0.01 of every 0.04 s spent waiting for data
    assert meter.images_per_s == pytest.approx(8 / 0.04)
    assert meter.untimed_s == pytest.approx(2 * 0.04), "the untimed steps' own cost is kept too"


def test_the_device_is_synchronised_twice_per_window_not_per_step(monkeypatch):
    calls = []
    monkeypatch.setattr(timing, "sync", lambda device=None: calls.append(device))
    run_loop(timing.Throughput("cuda:0", untimed_steps=3), steps=20, data_wait=0, compute=0)
    assert len(calls) == 2, "a synchronise per step would stop loading from overlapping GPU work"


def test_fewer_steps_than_untimed_gives_no_number():
    meter = timing.Throughput("cpu", untimed_steps=5)
    run_loop(meter, steps=3, data_wait=0, compute=0)
    assert meter.steps == 0 and meter.images_per_s != meter.images_per_s  # nan: nothing was timed
