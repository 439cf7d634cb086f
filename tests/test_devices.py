"""The device policy as a pure function: ranks per host never exceed GPUs per host with NCCL."""

from __future__ import annotations

import pytest

from course_utils.devices import PlacementError, RankView, place_ranks, plan_demo

A100 = ("GPU-a0", "GPU-a1")  # an FT3 node: 2 x A100
RTX = ("GPU-r0", "GPU-r1", "GPU-r2", "GPU-r3")  # a Frontera rtx node: 4 x Quadro RTX 5000


def devices(placements):
    return [p.device for p in placements]


def test_one_rank_per_gpu_on_a_full_node():
    out = place_ranks([RankView("c7-1", A100)] * 2)
    assert devices(out) == ["cuda:0", "cuda:1"]
    assert {p.backend for p in out} == {"nccl"} and not any(p.note for p in out)


def test_two_nodes_each_rank_takes_its_hosts_gpus_in_order():
    views = [RankView("c206-1", RTX)] * 4 + [RankView("c206-2", RTX)] * 4
    assert devices(place_ranks(views)) == [f"cuda:{k}" for k in range(4)] * 2


def test_srun_binding_one_gpu_per_task_is_not_a_clash():
    # srun --gpus-per-task=1: every task sees one GPU, a different one; each is its own cuda:0
    views = [RankView("c7-1", (g,)) for g in A100]
    out = place_ranks(views, "cuda")
    assert devices(out) == ["cuda:0", "cuda:0"] and out[0].backend == "nccl"


def test_portal_session_with_one_gpu_and_four_ranks_falls_back_to_cpu_on_auto():
    out = place_ranks([RankView("portal", ("GPU-x",))] * 4)
    assert devices(out) == ["cpu"] * 4 and {p.backend for p in out} == {"gloo"}
    assert "4 ranks on portal but only 1 GPU" in out[0].note


def test_asking_for_cuda_with_too_few_gpus_is_an_error_that_says_what_to_do():
    with pytest.raises(PlacementError, match=r"4 ranks on portal but only 1 GPU.*--nproc-per-node"):
        place_ranks([RankView("portal", ("GPU-x",))] * 4, "cuda")


def test_two_agents_on_one_host_would_share_a_gpu():
    # notebook 05's elastic demo: two single-process torchrun agents, both local rank 0, one GPU
    views = [RankView("portal", ("GPU-x",))] * 2
    with pytest.raises(PlacementError, match="2 ranks on portal but only 1 GPU"):
        place_ranks(views, "cuda")
    with pytest.raises(PlacementError, match="ranks 0 and 1 would share one GPU"):
        place_ranks(views, "cuda:0")
    assert devices(place_ranks(views)) == ["cpu", "cpu"]


def test_same_gpu_through_different_views_is_caught():
    # one task sees both GPUs, another is bound to GPU 0: UUIDs, not indices, reveal the clash
    views = [RankView("n1", A100), RankView("n1", (A100[0],))]
    with pytest.raises(PlacementError, match="share one GPU"):
        place_ranks(views, "cuda")
    assert place_ranks(views, "auto")[0].backend == "gloo"


def test_no_gpu_anywhere_is_gloo_on_auto_and_an_error_on_cuda():
    views = [RankView("laptop")] * 3
    assert {(p.device, p.backend, p.note) for p in place_ranks(views)} == {("cpu", "gloo", "")}, "nothing to explain"
    with pytest.raises(PlacementError, match="no CUDA GPU is visible"):
        place_ranks(views, "cuda")


def test_cpu_is_always_possible_and_unknown_devices_are_rejected():
    assert devices(place_ranks([RankView("n1", A100)] * 8, "cpu")) == ["cpu"] * 8
    with pytest.raises(ValueError, match="unknown device"):
        place_ranks([RankView("n1")], "tpu")


def test_without_nccl_the_gpus_are_driven_with_gloo():
    out = place_ranks([RankView("mac", ("GPU-m",))], nccl_available=False)
    assert (out[0].device, out[0].backend) == ("cuda:0", "gloo")


@pytest.mark.parametrize(
    ("wanted", "gpus", "minimum", "fallback", "expected"),
    [
        (4, 0, 1, "cpu", (4, "cpu", "gloo")),  # laptop: gloo ranks on the CPU
        (4, 4, 1, "cpu", (4, "cuda", "nccl")),  # Frontera rtx node
        (2, 4, 1, "cpu", (2, "cuda", "nccl")),  # more GPUs than asked: fine
        (4, 2, 1, "cap", (2, "cuda", "nccl")),  # FT3 node, capped at 2
        (4, 1, 2, "cap", (4, "cpu", "gloo")),  # portal: capping would leave 1 < minimum ranks
        (3, 1, 1, "cpu", (3, "cpu", "gloo")),  # portal: the demo keeps its ranks, on the CPU
    ],
)
def test_plan_demo(wanted, gpus, minimum, fallback, expected):
    plan = plan_demo(wanted, gpus, minimum, fallback)
    assert (plan.nproc, plan.device, plan.backend) == expected
    assert bool(plan.note) == (0 < gpus < wanted), "a note exactly when the plan differs from the request"
    assert plan.nproc <= gpus or plan.device == "cpu", "never more GPU ranks than GPUs"


def test_a_node_runs_all_its_ranks_on_gpus_or_all_on_the_cpu():
    from course_utils.devices import node_device

    assert [node_device("auto", 2, 2, r) for r in range(2)] == ["cuda:0", "cuda:1"]
    # a 1-GPU session asked for 2 ranks: both on the CPU, never one on NCCL and one on gloo
    assert [node_device("auto", 2, 1, r) for r in range(2)] == ["cpu", "cpu"]
    assert node_device("cpu", 1, 4, 0) == "cpu"
    assert node_device("auto", 1, 0, 0) == "cpu"
    with pytest.raises(PlacementError, match="2 ranks on this node but 1 GPU"):
        node_device("cuda", 2, 1, 0)
    with pytest.raises(ValueError, match="unknown device"):
        node_device("gpu", 1, 1, 0)


# --------------------------------------------------------------------------- #
# Deterministic kernels (course_utils.precision): the switch, from the environment and the device alone
# --------------------------------------------------------------------------- #
def test_deterministic_env_is_for_the_launched_run_and_leaves_this_process_alone(monkeypatch):
    import os

    from course_utils.precision import deterministic_env

    monkeypatch.delenv("COURSE_DETERMINISTIC", raising=False)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    env = deterministic_env()
    assert env == {"COURSE_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":4096:8"}
    assert "COURSE_DETERMINISTIC" not in os.environ and "CUBLAS_WORKSPACE_CONFIG" not in os.environ
    env["COURSE_DETERMINISTIC"] = "0"
    assert deterministic_env()["COURSE_DETERMINISTIC"] == "1", "a new dict each time"


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_determinism_switches_follow_the_environment(device_type):
    from course_utils.precision import deterministic_env, determinism_for

    on = {"use_deterministic_algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False}
    assert determinism_for({}, device_type) is None, "nothing asked: torch's defaults"
    assert determinism_for({"COURSE_DETERMINISTIC": "0"}, device_type) is None
    assert determinism_for(deterministic_env(), device_type) == on
    assert determinism_for({"COURSE_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":16:8"}, device_type) == on
    with pytest.raises(ValueError, match="COURSE_DETERMINISTIC='maybe'"):
        determinism_for({"COURSE_DETERMINISTIC": "maybe"}, device_type)


def test_determinism_on_a_gpu_needs_cublas_workspace_config_from_the_start():
    """cuBLAS reproduces its sums only with a fixed workspace per stream (CUDA >= 10.2), set in the environment
    the process starts with; without it torch's deterministic mode raises at the first matmul, after the data
    and the model were built. The switch says so at once, and a CPU needs nothing of the kind."""
    from course_utils.precision import determinism_for

    for env in ({"COURSE_DETERMINISTIC": "1"}, {"COURSE_DETERMINISTIC": "1", "CUBLAS_WORKSPACE_CONFIG": ":0:0"}):
        with pytest.raises(ValueError, match="CUBLAS_WORKSPACE_CONFIG=:4096:8") as err:
            determinism_for(env, "cuda")
        assert "deterministic_env()" in str(err.value)
        assert determinism_for(env, "cpu")["use_deterministic_algorithms"]


def test_apply_determinism_sets_torchs_switches_for_a_gpu_without_one():
    import torch

    from course_utils.precision import apply_determinism, deterministic_env, deterministic_state

    before = deterministic_state()
    try:
        torch.backends.cudnn.benchmark = True  # what --cudnn-benchmark leaves behind
        assert not apply_determinism("cuda", env={})
        assert deterministic_state()["cudnn_benchmark"], "nothing asked, nothing changed"
        assert apply_determinism("cuda", env=deterministic_env())
        assert deterministic_state() == {"use_deterministic_algorithms": True, "cudnn_deterministic": True,
                                         "cudnn_benchmark": False}
    finally:
        torch.use_deterministic_algorithms(before["use_deterministic_algorithms"])
        torch.backends.cudnn.deterministic = before["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = before["cudnn_benchmark"]
