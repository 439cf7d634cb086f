#!/usr/bin/env python3
"""The CI budget from a measured run: seconds per test file and per notebook, from pytest's JUnit XML.

    make test PYTEST_ARGS=--junitxml=runs/junit.xml
    python3 .ci/budget.py runs/junit.xml        # a Markdown table for CONTRIBUTING.md's budget
"""

import sys
import xml.etree.ElementTree as ET
from collections import defaultdict


def main(path: str) -> int:
    seconds: dict[str, float] = defaultdict(float)
    for case in ET.parse(path).getroot().iter("testcase"):
        cls, name = case.get("classname", ""), case.get("name", "")
        if "ipynb" in cls:  # nbval: classname "notebooks.00_environment.ipynb", one case per cell
            key = "notebooks/" + cls.split("notebooks.", 1)[-1]
        else:
            key = "tests/" + cls.split(".")[-1] + ".py" if cls.startswith("tests.") else cls
        seconds[key] += float(case.get("time", 0))
    total = sum(seconds.values())
    print("| part | seconds | share |\n|---|---:|---:|")
    for key, s in sorted(seconds.items(), key=lambda kv: -kv[1]):
        print(f"| `{key}` | {s:.0f} | {s / total:.0%} |")
    print(f"| **all tests** | **{total:.0f}** | |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "runs/junit.xml"))
