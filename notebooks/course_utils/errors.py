"""An error in one line: the course's messages say what went wrong in a line, then what to do next."""

from __future__ import annotations

import sys


def first_line(exc: BaseException, with_type: bool = False, limit: int = 300) -> str:
    """The first line of ``exc``'s message (at most ``limit`` characters), after its type's name with
    ``with_type``; its type's name alone where the message is empty."""
    text = str(exc).strip()
    line = text.splitlines()[0][:limit] if text else ""
    if not line:
        return type(exc).__name__
    return f"{type(exc).__name__}: {line}" if with_type else line


def fail(message: str, code: int = 2) -> int:
    """A script's end on an error it can name: ``error: <message>`` on stderr, and the exit code to return from
    ``main`` (2: the command line or its files are wrong; 1: the run could not start, such as ranks that never
    met)."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
