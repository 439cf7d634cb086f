"""One way to wait for something with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def wait_until(ready: Callable[[], T], timeout_s: float, on_timeout: str | Callable[[], BaseException],
               interval_s: float = 0.1) -> T:
    """Call ``ready()`` until it returns something truthy, and return that.

    At the deadline (``timeout_s`` seconds on the monotonic clock, which no
    clock adjustment moves) raise ``on_timeout()``, built then so that it can
    say what was still missing, or ``TimeoutError(on_timeout)`` for a string.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(on_timeout) if isinstance(on_timeout, str) else on_timeout()
        time.sleep(interval_s)
