"""Print how long each notebook took under nbval (summed over its cells)."""

from collections import defaultdict


def pytest_terminal_summary(terminalreporter):
    seconds: dict[str, float] = defaultdict(float)
    for reports in terminalreporter.stats.values():
        for report in reports:
            nodeid = getattr(report, "nodeid", "")
            if ".ipynb::" in nodeid:
                seconds[nodeid.split("::")[0]] += getattr(report, "duration", 0.0)
    if seconds:
        terminalreporter.section("notebook times")
        for path, total in sorted(seconds.items()):
            terminalreporter.write_line(f"{total:7.1f} s  {path}")
