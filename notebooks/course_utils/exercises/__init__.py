"""The notebooks' exercises: a cell for the learner, a checker that judges it against the run.

A learner's cell defines a function and marks it with :func:`exercise`::

    @exercise("ring_bytes")
    def ring_bytes(nbytes: int, world: int) -> float:
        raise NotImplementedError("bytes one rank sends in a ring all-reduce of nbytes")

Until it is filled, calling it stops Run All there with :class:`ExerciseNotDone`
(what to do, not the answer). The next cell hands it to a checker below, which
compares the answer with what the notebook measured and says why a wrong one
is wrong. With ``COURSE_SOLUTIONS=1`` (what the test suite sets) the reference
solution in :mod:`course_utils.solutions` runs instead, through the same checker.

The checkers live by the notebooks they judge: foundations (00-03), clusters (04-05),
frameworks (06-08), parallelism (09), data (10), debugging (11).
"""

from .core import SOLUTIONS_VAR, ExerciseNotDone, WrongAnswer, exercise, passed, solutions_enabled
from .foundations import (
    HALF_SPEED_CASES,
    accumulation_gap,
    accumulation_models,
    check_accumulation,
    check_accumulation_exact,
    check_half_speed_size,
    check_ring_bytes,
    check_strong_step,
)
from .clusters import INTERVAL_CASES, check_best_interval, check_sbatch_repair, colleagues_attempt
from .frameworks import (
    PACKING_CASES,
    STAGE_CASES,
    FABRIC_CASES,
    BASE_LR,
    SCALED_BATCHES,
    check_fabric_epoch,
    check_search_space,
    draw_configs,
    scaled_space_verdict,
    check_ds_config,
    check_trials_at_once,
    deepspeed_reads,
)
from .parallelism import (BUBBLE_CASES, check_interleaved_bubble, check_no_drop_capacity, check_tp_plan, run_tp_plans,
                          tp_plan_verdict)
from .data import AU_SLACK, PLAN_CASES, check_rank_loader
from .debugging import BEHIND_CASES, check_behind, made_records
