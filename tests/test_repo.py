"""Repository hygiene: notebooks are committed clean and teach in the agreed shape;
the pins in pyproject and constraints.txt agree."""

import json
import re
import tomllib

import pytest

from course_utils.paths import REPO_ROOT

NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))


def test_there_are_notebooks():
    assert [p.name[:2] for p in NOTEBOOKS] == [f"{i:02d}" for i in range(len(NOTEBOOKS))], "numbered in order"
    assert len(NOTEBOOKS) >= 6


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_has_no_outputs(path):
    nb = json.loads(path.read_text())
    dirty = [i for i, c in enumerate(nb["cells"]) if c["cell_type"] == "code"
             and (c.get("outputs") or c.get("execution_count") is not None)]
    assert not dirty, f"{path.name}: cells {dirty} carry outputs; clear them before committing"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_teaches_in_the_course_shape(path):
    nb = json.loads(path.read_text())
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert markdown.lstrip().startswith("# "), "opens with a title"
    assert "What you will learn" in markdown
    assert "Exercise" in markdown and "Solution" in markdown
    assert "import course_utils" in code or "from course_utils" in code
    assert "assert " in code, "a notebook checks what it teaches"


def _pins(lines):
    pins = {}
    for line in lines:
        m = re.match(r"^\s*([A-Za-z0-9_.\-]+)(?:\[[^\]]*\])?\s*==\s*([^\s;#]+)", line)
        if m:
            pins[m.group(1).lower().replace("_", "-")] = m.group(2)
    return pins


def test_constraints_agree_with_pyproject():
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    declared = project["dependencies"] + [d for ds in project["optional-dependencies"].values() for d in ds]
    wanted = _pins(declared)
    locked = _pins((REPO_ROOT / "constraints.txt").read_text().splitlines())
    assert wanted, "pyproject pins its direct dependencies"
    unpinned = [d for d in declared if "==" not in d]
    assert not unpinned, f"direct dependencies must be pinned exactly: {unpinned}"
    drift = {k: (v, locked.get(k)) for k, v in wanted.items() if locked.get(k) != v}
    assert not drift, f"pyproject and constraints.txt disagree (pyproject, constraints): {drift}; run make lock"
