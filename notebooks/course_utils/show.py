"""The lesson's lines on the page: a function's source, the lines of a script, a command line, highlighted and read
at run time from what runs (never a copy that can drift). Each shows its code and returns nothing (a returned value
would be shown a second time)."""

from __future__ import annotations

import difflib
import inspect
import re
import shlex
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from .paths import REPO_ROOT, SCRIPTS

LANGUAGES = {".py": "python", ".sh": "bash", ".sbatch": "bash", ".in": "bash", ".toml": "toml", ".json": "json"}


def _display(code: str, language: str) -> None:
    from IPython.display import Code, display

    display(Code(code.rstrip("\n"), language=language))


def _path(file: str | Path) -> Path:
    path = Path(file)
    if path.is_absolute() or path.exists():
        return path
    return SCRIPTS / path if (SCRIPTS / path).exists() else REPO_ROOT / path


def show_function(fn: Callable) -> None:
    """The source of ``fn``, as it is in the module that runs it."""
    _display(textwrap.dedent(inspect.getsource(fn)), "python")


def show_lines(file: str | Path, start: str, end: str | None = None) -> None:
    """The lines of ``file`` (a script's name, or a path under the repository) from the first containing ``start``
    through the next containing ``end`` (or the end of that block: the first blank line)."""
    path = _path(file)
    lines = path.read_text().splitlines()
    first = next((i for i, line in enumerate(lines) if start in line), None)
    if first is None:
        raise ValueError(f"{path.name} has no line containing {start!r}")
    if end:
        stop = next((i for i in range(first, len(lines)) if end in lines[i]), None)
        if stop is None:
            raise ValueError(f"{path.name} has no line containing {end!r} after {start!r}")
        shown = lines[first:stop + 1]
    else:
        stop = next((i for i in range(first + 1, len(lines)) if not lines[i].strip()), len(lines))
        shown = lines[first:stop]
    _display(textwrap.dedent("\n".join(shown)), LANGUAGES.get(path.suffix, "text"))


def show_diff(old: str | Path, new: str | Path) -> None:
    """The lines that change from script ``old`` to script ``new``: a unified diff of their code from the first
    ``import`` on, blank lines left out, one line of context around each change, and before each hunk an ``@@`` line
    with where it is in both files, so that no part of either is skipped without a mark."""
    a, b = _numbered_body(old), _numbered_body(new)
    matcher = difflib.SequenceMatcher(None, [t for _, t in a], [t for _, t in b], autojunk=False)

    def at(lines: list[tuple[int, str]], k: int) -> int:
        return lines[k][0] if k < len(lines) else lines[-1][0] + 1

    out = [f"--- {Path(old).name}", f"+++ {Path(new).name}"]
    for group in matcher.get_grouped_opcodes(1):
        _, i, _, j, _ = group[0]
        out.append(f"@@ {Path(old).name} line {at(a, i)}, {Path(new).name} line {at(b, j)} @@")
        for tag, i1, i2, j1, j2 in group:
            if tag == "equal":
                out += [" " + t for _, t in a[i1:i2]]
            if tag in ("replace", "delete"):
                out += ["-" + t for _, t in a[i1:i2]]
            if tag in ("replace", "insert"):
                out += ["+" + t for _, t in b[j1:j2]]
    _display("\n".join(out), "diff")


def _numbered_body(file: str | Path) -> list[tuple[int, str]]:
    """A script's non-blank lines from its first ``import`` on, with their line numbers."""
    lines = [(k, line) for k, line in enumerate(_path(file).read_text().splitlines(), 1) if line.strip()]
    return lines[next(i for i, (_, line) in enumerate(lines) if line.startswith(("import ", "from "))):]


def show_matching(file: str | Path, pattern: str) -> None:
    """The lines of ``file`` that match the regular expression ``pattern``, in order (e.g. every ``dist.`` call)."""
    path = _path(file)
    found = [line.strip() for line in path.read_text().splitlines() if re.search(pattern, line)]
    if not found:
        raise ValueError(f"{path.name} has no line matching {pattern!r}")
    _display("\n".join(found), LANGUAGES.get(path.suffix, "text"))


def command_line(cmd: Sequence[str], env: Mapping[str, str] | None = None) -> str:
    """A command as a person types it: ``python -m torch.distributed.run`` is ``torchrun``, this Python is
    ``python`` and the tools installed beside it go by their names (``py-spy``), the repository's paths are relative to its root; ``env``, the variables set for it, in front."""
    words = [str(w) for w in cmd]
    if words[:3] == [sys.executable, "-m", "torch.distributed.run"]:
        words = ["torchrun", *words[3:]]
    bin_dir = str(Path(sys.executable).parent)  # this Python's own tools (py-spy, torchrun) by their names
    words = ["python" if w == sys.executable else Path(w).name if str(Path(w).parent) == bin_dir else w
             for w in words]
    here = [relative(w) for w in words]  # also inside --flag=/path
    return " ".join([*(f"{k}={shlex.quote(str(v))}" for k, v in (env or {}).items()), shlex.join(here)])


def relative(text: str) -> str:
    """``text`` with the repository's absolute paths written relative to its root, as a learner there types them."""
    return text.replace(f"{REPO_ROOT}/", "")


def show_command(cmd: Sequence[str]) -> None:
    """A command line (a run's ``command``), as :func:`command_line` writes it."""
    _display(command_line(cmd), "bash")
