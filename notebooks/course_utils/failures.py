"""What failures cost a job that checkpoints: random failures replayed on a checkpoint timeline (notebook 05).

The job trains ``every_s`` seconds, stalls ``write_s`` to write a checkpoint, and so on; failures arrive at
random (exponentially distributed gaps, ``mtbf_s`` on average). A failure throws away what was trained since
the last checkpoint that finished; the job resumes from it at once (a restart's own cost is left out).
"""

from __future__ import annotations

import random


def replay_failures(every_s: float, write_s: float, mtbf_s: float, work_s: float, seed: int = 0) -> dict[str, float]:
    """Replay a job of ``work_s`` seconds of training: its wall time, and the shares of it spent writing and lost.
    One draw per failure: between two failures the job completes every whole segment-and-write that fits."""
    rng = random.Random(seed)
    cost = every_s + write_s  # one segment and its checkpoint
    done = wall = written = lost = 0.0
    while True:
        gap = rng.expovariate(1 / mtbf_s)  # until the next failure
        left = work_s - done
        whole, tail = divmod(left, every_s)
        finish = whole * cost + (tail + write_s if tail > 1e-9 * every_s else 0.0)
        if gap >= finish:  # the job ends first
            wall, written = wall + finish, written + (finish - left)
            break
        k = min(int(gap // cost), int(whole))  # checkpoints on disk before the failure
        done, written, lost, wall = done + k * every_s, written + k * write_s, lost + gap - k * cost, wall + gap
    return {"wall_s": wall, "writing": written / wall, "lost": lost / wall, "waste": (wall - work_s) / wall}
