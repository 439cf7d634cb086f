"""A section's checks as the claims they verify: one call after the output, one printed line per claim, and the
first claim that does not hold stops the cell, named. The learner reads what the run showed, not twenty asserts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

Claim = tuple[str, "bool | Callable[[], bool]"]


class ClaimFailed(AssertionError):
    """A claim the lesson makes did not hold in this run."""


def verify(claims: Sequence[Claim], detail: str | Callable[[], str] = "") -> None:
    """Check each ``(claim, holds)`` in order (``holds`` may be a function, called only once the claims before it
    held), print ``✓ claim`` for each, and raise :class:`ClaimFailed` naming the first that does not hold, with
    ``detail`` (a run's output, say) beneath it."""
    for text, holds in claims:
        if not (holds() if callable(holds) else holds):
            more = detail() if callable(detail) else detail
            raise ClaimFailed(f"this run does not show that {text}" + (f"\n{more}" if more else ""))
        print(f"✓ {text}")
