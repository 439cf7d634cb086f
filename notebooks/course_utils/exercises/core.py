"""The exercise marker and what every checker shares: the learner's unfinished cell, a wrong answer's verdict."""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])

SOLUTIONS_VAR = "COURSE_SOLUTIONS"


class ExerciseNotDone(Exception):
    """The learner's cell still raises NotImplementedError."""


class WrongAnswer(AssertionError):
    """The checker's verdict on a wrong answer, with the reason."""


def solutions_enabled() -> bool:
    return os.environ.get(SOLUTIONS_VAR, "").strip() == "1"


def exercise(name: str) -> Callable[[F], F]:
    """Mark the learner's function for exercise ``name`` (see the module's docstring)."""

    def mark(fn: F) -> F:
        if solutions_enabled():
            from .. import solutions

            return getattr(solutions, name)

        @functools.wraps(fn)
        def learner(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except NotImplementedError as exc:
                raise ExerciseNotDone(
                    f"Exercise '{name}' is yours to write: {exc}. Replace the `raise NotImplementedError` "
                    "in the cell above with your code, run that cell, then this one; the check says whether "
                    "your answer matches this run's measurements."
                ) from None

        return learner  # type: ignore[return-value]

    return mark


def _close(got: float, want: float, rel: float) -> bool:
    return math.isfinite(got) and abs(got - want) <= rel * abs(want) + 1e-9


def passed(message: str) -> None:
    """The check's verdict: what the answer got right, for the learner who wrote it. A copy executed with the
    reference answers (the site, make test) says only that it passed: read before a workshop, it must not give
    the answer away (its label says once that the exercises ran with the reference answers)."""
    print("correct: the reference answer passed this check" if solutions_enabled() else f"correct: {message}")
