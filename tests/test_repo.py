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
    ids = [c.get("id") for c in nb["cells"]]
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: every cell needs an id of its own (nbformat 4.5)"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_teaches_in_the_course_shape(path):
    nb = json.loads(path.read_text())
    markdown = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert markdown.lstrip().startswith("# "), "opens with a title"
    assert "What you will learn" in markdown
    assert "## Exercise" in markdown
    assert "## What you learned" in markdown and "## Further reading" in markdown, "it closes with a summary"
    assert "import course_utils" in code or "from course_utils" in code


MAX_WORDS = 150  # a markdown cell a learner reads in one go, between two runs


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_markdown_cells_are_short(path):
    def words(text: str) -> int:  # prose only: a fenced command or an address is not read as words
        return len(re.sub(r"https?://\S+", "", re.sub(r"```.*?```", "", text, flags=re.S)).split())

    cells = json.loads(path.read_text())["cells"]
    long = {i: n for i, c in enumerate(cells) if c["cell_type"] == "markdown"
            and (n := words("".join(c["source"]))) > MAX_WORDS}
    assert not long, f"{path.name}: markdown cells over {MAX_WORDS} words (cell: words): {long}; split or cut them"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.name)
def test_notebook_ends_with_a_checked_exercise(path):
    from course_utils import exercises, solutions

    cells = json.loads(path.read_text())["cells"]
    code = ["".join(c["source"]) for c in cells if c["cell_type"] == "code"]
    marked = [(i, m.group(1)) for i, src in enumerate(code) for m in re.finditer(r'@exercise\("([a-z_]+)"\)', src)]
    assert marked, f"{path.name}: no @exercise cell for the learner"
    for i, name in marked:
        assert hasattr(solutions, name), f"{path.name}: exercise {name!r} has no reference solution"
        learner = code[i]
        assert "raise NotImplementedError" in learner, "the learner's cell starts unsolved"
        checks = [c for c in code[i + 1:] if re.search(r"check_[a-z_]+\(" + name, c)]
        assert checks, f"{path.name}: no checker judges {name!r} after its cell"
        checker = re.search(r"(check_[a-z_]+)\(" + name, checks[0]).group(1)
        assert hasattr(exercises, checker), checker
    assert not any("solution" in c.get("metadata", {}).get("tags", []) for c in cells), \
        "no solution cell for Run All to execute: the reference lives in course_utils.solutions"


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


def test_the_package_index_lists_every_module():
    """course_utils/__init__.py is where a reader finds what the package holds: every module and subpackage."""
    package = REPO_ROOT / "notebooks" / "course_utils"
    modules = {p.stem for p in package.glob("*.py") if p.stem != "__init__"}
    modules |= {p.parent.name for p in package.glob("*/__init__.py")}
    listed = {line.split()[0] for line in (package / "__init__.py").read_text().split("::", 1)[1].split('"""')[0]
              .splitlines() if line.startswith("    ") and not line.startswith("     ")}
    listed.add("solutions")  # listed beside exercises, whose answers it holds
    assert modules == listed, f"not in the index: {sorted(modules - listed)}; listed but gone: {sorted(listed - modules)}"
