"""What this Python lacks for gpu-check's notebooks, and the one line that says how to carry it
(scripts/gpu_wheels.sh). The standard library only: it runs before anything else on a machine that has nothing
but its own torch."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = REPO_ROOT / "scripts"
MIN_TORCH = (2, 11)  # the oldest torch the course runs on (README)
TORCH_OWN = {"torch", "torchvision", "torchaudio"}  # the machine's own builds: their dependencies are its business
SITE = "/tmp/course-site"  # where `scripts/gpu_wheels.sh install` puts what was carried


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(p) for p in re.findall(r"\d+", version.split("+")[0])[:2])


def _requirement_parser():
    """packaging's Requirement (pip's copy where packaging itself is missing), or None."""
    try:
        from packaging.requirements import Requirement
    except ImportError:
        try:
            from pip._vendor.packaging.requirements import Requirement
        except ImportError:
            return None
    return Requirement


def missing_packages(roots: Sequence[str], installed: Mapping[str, Sequence[str]]) -> list[str]:
    """The distributions that ``roots`` (requirement strings) need, directly or through what is installed,
    and ``installed`` (normalised name -> its Requires-Dist lines) lacks. Versions are not compared: the
    machine's own Lightning or matplotlib will do. Without packaging to read markers, only requirements
    without a marker are followed."""
    parser = _requirement_parser()
    missing: dict[str, str] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    todo = list(roots)
    while todo:
        spec = todo.pop()
        if parser is None:
            if ";" in spec:
                continue
            name, extras = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", spec).group(1), frozenset()
        else:
            try:
                req = parser(spec)
            except Exception:  # a malformed line in some package's metadata is not ours to judge
                continue
            name, extras = req.name, frozenset(req.extras)
        key = _norm(name)
        if (key, extras) in seen or key in TORCH_OWN and key in installed:
            continue
        seen.add((key, extras))
        if key not in installed:
            missing.setdefault(key, name)
            continue
        for line in installed[key]:
            if "extra ==" in line and not any(f'"{e}"' in line for e in extras):
                continue  # another extra's (most of what packages list): no parse needed
            if parser is not None:
                try:
                    marker = parser(line).marker
                except Exception:
                    continue
                if marker is not None and not any(marker.evaluate({"extra": e}) for e in (*extras, "")):
                    continue
            elif ";" in line:
                continue
            todo.append(line)
    return sorted(missing.values(), key=str.lower)


def lacking_line(python: str, python_version: tuple[int, ...], torch_version: str | None, missing: Sequence[str],
                 wheels: Mapping[str, str], have: Collection[str] = ()) -> str | None:
    """One line: what this Python lacks for a notebook run and the command that carries it, or None.

    ``wheels``: scripts/gpu_wheels.sh's list (normalised name -> "carried" when its download fetches
    it by default, "there" when only when named: the lent GPU machine's image has it). ``have``: the
    normalised names installed here; the "there" ones it lacks are named too, since what a missing
    package needs cannot be read before it is installed (one carry, not one per layer)."""
    if tuple(python_version[:2]) < (3, 11):
        return (f"error: gpu-check needs Python 3.11 or newer (tomllib); {python} is "
                f"{'.'.join(map(str, python_version[:3]))}: make gpu-check GPU_PYTHON=/path/to/python3.11+")
    if torch_version is None or _version_tuple(torch_version) < MIN_TORCH:
        have = "has no torch" if torch_version is None else f"has torch {torch_version}"
        return (f"error: {python} {have}; gpu-check runs on the machine's own torch "
                f"{'.'.join(map(str, MIN_TORCH))} or newer: make gpu-check GPU_PYTHON=/path/to/the/python/with/it")
    if not missing:
        return None
    named = sorted({_norm(m) for m in missing if wheels.get(_norm(m)) == "there"}
                   | {n for n, where in wheels.items() if where == "there" and n not in have})
    elsewhere = [m for m in missing if _norm(m) not in wheels]
    line = (f"error: {python} (torch {torch_version}) lacks {len(missing)} package(s) the notebooks need: "
            f"{', '.join(missing)}. Carry them: on a machine with a package index, `scripts/gpu_wheels.sh download"
            f"{''.join(' ' + m for m in named)}`; bring each .whl/carry-N folder it makes here and "
            f"run `scripts/gpu_wheels.sh install` after each; then `export PYTHONPATH={SITE}` and `make gpu-check` again")
    if elsewhere:
        line += (f" ({', '.join(elsewhere)}: scripts/gpu_wheels.sh does not carry "
                 f"{'it' if len(elsewhere) == 1 else 'them'}; install from where this Python's torch came from)")
    return line + "."


def what_is_lacking() -> str | None:
    """:func:`lacking_line` for this Python: pyproject's dependencies and test extras, followed through the
    installed packages' metadata; the standard library only, no import of torch."""
    if sys.version_info < (3, 11):
        return lacking_line(sys.executable, tuple(sys.version_info), None, [], {})
    import tomllib
    from importlib.metadata import distributions

    found: dict[str, Any] = {}
    for dist in distributions():  # in sys.path order: the first one found is the one imported
        # the folder's name where it gives one (reading every package's metadata takes a second)
        name = getattr(dist, "_normalized_name", None) or dist.metadata["Name"]
        if name:
            found.setdefault(_norm(name), dist)

    class Installed(dict):  # read a package's requirements only when the walk reaches it
        def __missing__(self, key: str) -> list[str]:
            self[key] = found[key].metadata.get_all("Requires-Dist") or []
            return self[key]

        def __contains__(self, key: object) -> bool:
            return key in found

    installed = Installed()
    versions = {"torch": found["torch"].version} if "torch" in found else {}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    roots = [r for r in [*project["dependencies"], *project["optional-dependencies"]["test"]]
             if _norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) != "torch"]  # torch: its version, below
    wheels = {}
    out = subprocess.run(["bash", str(SCRIPTS / "gpu_wheels.sh"), "needs"], capture_output=True, text=True, timeout=60)
    for line in out.stdout.splitlines():
        pin, where, *_ = line.split() + ["", ""]
        wheels[_norm(pin.split("==")[0])] = where
    return lacking_line(sys.executable, tuple(sys.version_info), versions.get("torch"),
                        missing_packages(roots, installed), wheels, set(found))
