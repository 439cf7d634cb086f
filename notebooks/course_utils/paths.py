"""Where the course's files are, found from this package's own location, and the environment a child process needs to import them."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parent.parent
"""The folder that holds ``course_utils`` (``notebooks/``): what a child process needs on ``PYTHONPATH``."""

REPO_ROOT = PACKAGE_PARENT.parent
SCRIPTS = REPO_ROOT / "scripts"


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a launched script: ours, plus ``course_utils`` on
    ``PYTHONPATH`` (so it imports even where the package is not installed)."""
    env = {**os.environ, **(extra or {})}
    paths = [str(PACKAGE_PARENT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed, not at exit
    return env
