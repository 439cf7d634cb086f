import pytest
import torch

from course_utils import sizing


@pytest.mark.parametrize("gpus, profile", [(0, "ci"), (1, "full"), (4, "full")])
def test_default_follows_the_hardware(monkeypatch, gpus, profile):
    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)
    assert sizing.current_profile() == profile


@pytest.mark.parametrize("value, expected", [("ci", "ci"), ("FULL", "full"), (" ci ", "ci")])
def test_explicit_profile(monkeypatch, value, expected):
    monkeypatch.setenv("COURSE_PROFILE", value)
    assert sizing.current_profile() == expected
    assert sizing.pick(ci=1, full=2) == (1 if expected == "ci" else 2)


def test_invalid_profile_lists_the_valid_ones(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "fast")
    with pytest.raises(ValueError, match=r"'fast'.*ci, full"):
        sizing.current_profile()


def test_a_demo_moved_to_the_cpu_in_a_gpu_session_gets_cpu_sizes(monkeypatch):
    monkeypatch.setenv("COURSE_PROFILE", "full")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert sizing.pick(ci=1, full=2, device="cpu") == 1
    assert sizing.pick(ci=1, full=2, device="cuda") == 2
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    assert sizing.pick(ci=1, full=2, device="cpu") == 2, "full on a CPU machine was asked for explicitly"
