"""TensorBoard event files read back: the scalars a run logged, for a notebook's figure or a test."""

from __future__ import annotations

from pathlib import Path


def scalars(log_dir: str | Path, tag: str) -> tuple[list[int], list[float]]:
    """Steps and values of scalar ``tag`` in every event file of ``log_dir``, in the order written
    (a resumed run's file after the first run's)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})  # 0: keep every point
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if tag not in tags:
        raise KeyError(f"{log_dir} holds no scalar {tag!r}; it holds: {', '.join(sorted(tags)) or 'none'}")
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]
