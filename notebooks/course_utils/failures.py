"""What failures cost a job that checkpoints: random failures replayed on a checkpoint timeline (notebook 05).

The job trains ``every_s`` seconds, stalls ``write_s`` to write a checkpoint, and so on; failures arrive at
random (exponentially distributed gaps, ``mtbf_s`` on average). A failure throws away what was trained since
the last checkpoint that finished; the job resumes from it at once (a restart's own cost is left out).
"""

from __future__ import annotations

import random


def replay_failures(every_s: float, write_s: float, mtbf_s: float, work_s: float, seed: int = 0) -> dict[str, float]:
    """Replay a job of ``work_s`` seconds of training: its wall time, and the shares of it spent writing and lost."""
    rng = random.Random(seed)
    done = wall = written = lost = 0.0
    next_failure = rng.expovariate(1 / mtbf_s)
    while done < work_s:
        segment = min(every_s, work_s - done)
        cost = segment + write_s
        if wall + cost <= next_failure:  # trained, and the checkpoint is on disk
            wall, done, written = wall + cost, done + segment, written + write_s
            continue
        lost += next_failure - wall  # the segment (and any half-written checkpoint) is gone
        wall = next_failure
        next_failure = wall + rng.expovariate(1 / mtbf_s)
    return {"wall_s": wall, "writing": written / wall, "lost": lost / wall, "waste": (wall - work_s) / wall}
