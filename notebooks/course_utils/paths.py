"""Where the course's files are, found from this package's own location."""

from __future__ import annotations

from pathlib import Path

PACKAGE_PARENT = Path(__file__).resolve().parent.parent
"""The folder that holds ``course_utils`` (``notebooks/``): what a child process needs on ``PYTHONPATH``."""

REPO_ROOT = PACKAGE_PARENT.parent
SCRIPTS = REPO_ROOT / "scripts"
