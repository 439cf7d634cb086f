"""Session-wide hooks: system tools installed once, notebook times, the Slurm test cluster for 04-06,
and the notebooks' exercises answered by their reference solutions."""

import importlib.util
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest


def pytest_terminal_summary(terminalreporter):
    """Print how long each notebook took under nbval (summed over its cells)."""
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


def _module(name: str, path: str):
    """The file ``path`` of the repository, imported once as module ``name``."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).parent / path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def _slurm_cluster_module():
    """slurm/practice_cluster.py, under the name the Slurm tests use."""
    return _module("slurm_cluster", "slurm/practice_cluster.py")


def _record_executed():
    """scripts/record_executed.py: the plugin that writes each notebook with its outputs as it runs."""
    return _module("record_executed", "scripts/record_executed.py")


def pytest_configure(config):
    # Notebook kernels inherit this: each exercise runs its reference solution through the same
    # checker a learner's answer meets (course_utils.exercises); a learner's Run All stops there.
    os.environ.setdefault("COURSE_SOLUTIONS", "1")
    # make test (COURSE_EXECUTED_DIR): each notebook written with its outputs as it runs, for make site; make
    # gpu-check loads the same plugin itself (-p record_executed)
    if os.environ.get("COURSE_EXECUTED_DIR") and not config.pluginmanager.has_plugin("record_executed"):
        config.pluginmanager.register(_record_executed(), "record_executed")


def pytest_sessionstart(session):
    """Install the system tools the suite needs (slurm-wlm, shellcheck) once, before any test,
    where this machine can (root on Linux): no test then skips on a fresh machine for want of them.
    Where it cannot (no network for apt, or COURSE_NO_APT from `make gpu-check`), say why once here;
    the tests that need them skip with the same reason."""
    module = _slurm_cluster_module()
    reason = module.unavailable_reason()
    if reason is None:
        reason = module.ensure_installed()
    if reason and getattr(os, "geteuid", lambda: -1)() == 0:  # as root the suite would have installed them
        reporter = session.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            reporter.write_line(f"system tools: {reason}")
        else:
            print(f"system tools: {reason}", file=sys.stderr)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    # Notebooks 04, 05 and 06 submit real jobs when they find a cluster: start the test cluster
    # (where this machine can run one) before the notebook's kernel starts.
    path = "/" + item.nodeid.split("::")[0]
    if path.endswith(".ipynb") and any(f"/{n}_" in path for n in ("04", "05", "06")):
        module = _slurm_cluster_module()
        if module.unavailable_reason() is None:
            module.shared()


def pytest_sessionfinish(session, exitstatus):
    module = sys.modules.get("slurm_cluster")
    if module is not None:
        module.stop_shared()
