"""The CUDA branches, tested on a CPU machine with the hardware facts as input.

Each test gives the facts a GPU node would show (compute capability, visible GPUs, Slurm's
binding, a driver torch cannot use) and checks the decision the course makes from them: the
precision, each script family's device, and that nothing starts CUDA or changes the
environment where a notebook kernel calls it. Where a function reads ``torch.cuda`` itself,
``torch.cuda`` is given those facts with monkeypatch; the functions that must not touch the GPU
(``is_bf16_supported``, ``is_available`` in a kernel) are replaced by ones that fail the test, and whether a
kernel can still fork is read from torch's own record in a fresh Python.
"""

from __future__ import annotations

import os
import signal
import sys
import types
import warnings
from pathlib import Path

import pytest
import torch

from course_utils.devices import (PlacementError, RankView, VisibleGpu, cuda_unusable_note, gpu_ids, gpus_bound,
                                  node_device, place_ranks)
from course_utils import precision
from course_utils.lit import LaunchMismatch, plan_launch, strategy_refused
from lightning.fabric.strategies.deepspeed import _validate_device_index_selection
from course_utils.precision import precision_for, resolve_precision, set_tf32, tf32_state

# compute capabilities of the course's GPUs
TURING, AMPERE, HOPPER = (7, 5), (8, 0), (9, 0)  # Frontera's RTX 5000, FT3's A100, an H100


def _forbidden(name):
    def fail(*args, **kwargs):
        raise AssertionError(f"{name} was called")
    return fail


@pytest.mark.parametrize("capability, amp", [(TURING, "fp16"), (AMPERE, "bf16"), (HOPPER, "bf16")])
def test_amp_is_bf16_from_ampere_on_and_fp16_before(capability, amp):
    assert precision_for("amp", "cuda", capability) == amp
    assert precision_for("fp16", "cuda", capability) == "fp16"
    assert precision_for("fp32", "cuda", capability) == "fp32"


def test_bf16_on_turing_is_refused_with_what_to_use_instead():
    with pytest.raises(ValueError, match=r"Quadro RTX 5000 \(compute capability 7.5\) has no bf16.*fp16 or amp"):
        precision_for("bf16", "cuda", TURING, "Quadro RTX 5000")
    assert precision_for("bf16", "cuda", AMPERE) == "bf16"


# /proc/cpuinfo's lines, abridged: a Sapphire Rapids Xeon (AMX), a Zen 4 EPYC (AVX-512 BF16), the 2-core AVX2
# EPYC CI runs on (bf16 matmuls measured 80x slower than fp32 there), and a Graviton3 (Arm, BF16)
SAPPHIRE_RAPIDS = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512bw avx512_bf16 amx_bf16 amx_tile\n"
ZEN4 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f avx512_bf16\n"
AVX2_EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma\n"
GRAVITON3 = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"


@pytest.mark.parametrize("cpuinfo, amp", [(SAPPHIRE_RAPIDS, "bf16"), (ZEN4, "bf16"), (AVX2_EPYC, "fp32"),
                                          (GRAVITON3, "bf16"), ("", "fp32")])
def test_amp_on_a_cpu_is_bf16_only_where_the_cpu_has_bf16_instructions(cpuinfo, amp):
    """Emulated bf16 is not a speed-up: on the AVX2 EPYC a bf16 autocast CNN trained 3.5x slower than in fp32.
    bf16 asked for by name still runs (emulated), as notebook 07's memory lesson needs; fp16 stays a GPU format."""
    bf16 = precision.cpu_has_bf16(precision.cpu_flags(cpuinfo))
    assert precision_for("amp", "cpu", cpu_bf16=bf16) == amp
    assert precision_for("bf16", "cpu", cpu_bf16=bf16) == "bf16"
    assert precision_for("fp32", "cpu", cpu_bf16=bf16) == "fp32"
    with pytest.raises(ValueError, match="GPU technique"):
        precision_for("fp16", "cpu", cpu_bf16=bf16)


def test_a_cpu_run_resolves_amp_from_this_machine_s_own_flags(monkeypatch):
    """resolve_precision (every trainer's door) reads the flags of the CPU it runs on: here, two CPUs' lines."""
    assert "fpu" in precision.cpu_flags() or sys.platform != "linux", "read from /proc/cpuinfo on Linux"
    read = precision.cpu_flags
    for cpuinfo, amp in ((AVX2_EPYC, "fp32"), (SAPPHIRE_RAPIDS, "bf16")):
        monkeypatch.setattr(precision, "cpu_flags", lambda text=cpuinfo: read(text))
        assert resolve_precision("amp", "cpu") == amp


def test_the_ladder_s_amp_rung_on_a_cpu_runs_where_bf16_is_in_hardware_and_is_skipped_where_not(monkeypatch):
    from course_utils import ladder

    read = precision.cpu_flags
    for cpuinfo, name, skip in ((SAPPHIRE_RAPIDS, "+ AMP (bf16)", None),
                                (AVX2_EPYC, "+ AMP (fp32)", "this CPU has no bf16 instructions: amp is fp32 here")):
        monkeypatch.setattr(precision, "cpu_flags", lambda text=cpuinfo: read(text))
        (amp,) = [r for r in ladder.rungs(torch.device("cpu"), ladder.LadderSettings()) if r[1] == {"precision": "amp"}]
        assert (amp[0], amp[2]) == (name, skip)


def _gpus(monkeypatch, capabilities, names=None):
    """This process sees GPUs of these capabilities (properties only: nothing is allocated)."""
    def props(index):
        major, minor = capabilities[index]
        return types.SimpleNamespace(major=major, minor=minor, name=(names or {}).get(index, f"GPU {index}"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: len(capabilities))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    # emulation counts bf16 on Turing, and the check allocates on the current GPU: never asked
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", _forbidden("torch.cuda.is_bf16_supported"))


def test_a_rank_resolves_its_precision_from_its_own_gpu_without_allocating(monkeypatch):
    _gpus(monkeypatch, [AMPERE, TURING], {1: "Quadro RTX 5000"})
    monkeypatch.setattr(torch.cuda, "current_device", _forbidden("current_device (GPU 0's context)"))
    assert resolve_precision("amp", torch.device("cuda:0")) == "bf16"
    assert resolve_precision("amp", torch.device("cuda:1")) == "fp16"
    with pytest.raises(ValueError, match="Quadro RTX 5000"):
        resolve_precision("bf16", "cuda:1")


def test_the_ladder_names_frontera_s_amp_rung_fp16(monkeypatch):
    from course_utils.ladder import LadderSettings, rungs

    _gpus(monkeypatch, [TURING])
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: TURING)
    names = [name for name, _, _ in rungs(torch.device("cuda:0"), LadderSettings())]
    assert "+ AMP (fp16)" in names, names


@pytest.mark.parametrize("ranks, gpus, bound, expected", [
    (2, 2, False, ["cuda:0", "cuda:1"]),          # torchrun on an FT3 node: rank k takes GPU k
    (4, 4, False, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),  # a Frontera rtx node
    (2, 1, True, ["cuda:0", "cuda:0"]),            # srun --gpus-per-task=1: each task's own GPU is its cuda:0
    (4, 1, True, ["cuda:0"] * 4),
    (2, 1, False, ["cpu", "cpu"]),                 # a 1-GPU portal asked for 2 ranks: all on the CPU
    (1, 1, False, ["cuda:0"]),
    (2, 0, False, ["cpu", "cpu"]),
])
def test_each_rank_of_a_node_gets_a_gpu_of_its_own_or_the_cpu(ranks, gpus, bound, expected):
    assert [node_device("auto", ranks, gpus, r, bound) for r in range(ranks)] == expected


def test_cuda_without_a_gpu_for_each_rank_stops_in_one_line():
    with pytest.raises(PlacementError, match="2 ranks on this node but 1 GPU"):
        node_device("cuda", 2, 1, 1, bound=False)
    with pytest.raises(PlacementError, match="sees no GPU"):
        node_device("cuda", 1, 0, 0, bound=True)
    assert node_device("cuda", 2, 1, 1, bound=True) == "cuda:0"


@pytest.mark.parametrize("env, bound", [
    ({}, False),
    ({"SLURM_GPUS_PER_TASK": "1"}, True),
    ({"SLURM_GPU_BIND": "single:1"}, True),         # COURSE_GPU_BIND=single:1 in course_job.sh
    ({"SLURM_GPU_BIND": "closest"}, True),
    ({"SLURM_GPU_BIND": "map_gpu:0,1"}, True),
    ({"SLURM_GPU_BIND": "none"}, False),
    ({"SLURM_GPU_BIND": "none,verbose"}, False),
])
def test_slurm_gpu_binding_is_read_from_the_task_s_environment(env, bound):
    assert gpus_bound(env) is bound


SRUN_2x2 = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
            "SLURM_STEP_NUM_TASKS": "4"}


@pytest.mark.parametrize("env, gpus, devices", [
    ({**SRUN_2x2, "SLURM_LOCALID": "1"}, 2, ("cuda:0", "cuda:1")),  # every task sees both: GPU LOCALID
    ({**SRUN_2x2, "SLURM_LOCALID": "1", "SLURM_GPUS_PER_TASK": "1"}, 1, ("cuda:0", "cuda:0")),
    ({**SRUN_2x2, "SLURM_LOCALID": "1", "SLURM_GPU_BIND": "single:1"}, 1, ("cuda:0", "cuda:0")),
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 4, ("cuda:0", "cuda:1", "cuda:2", "cuda:3")),
    # torchrun in a JupyterLab job that Slurm started as one task: torchrun's layout, as Lightning reads it
    ({"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "lab", "TORCHELASTIC_RUN_ID": "none", "LOCAL_WORLD_SIZE": "2",
      "WORLD_SIZE": "2", "LOCAL_RANK": "1"}, 2, ("cuda:0", "cuda:1")),
    ({}, 2, ("cuda:0",)),  # python train_lightning.py on a 2-GPU node: one process, one GPU
])
def test_lightning_and_fabric_get_this_rank_s_gpu_from_the_policy(env, gpus, devices):
    plan = plan_launch("auto", None, None, gpus_visible=gpus, env=env)
    assert plan.accelerator == "gpu" and plan.parallel_devices == devices
    assert plan.device == torch.device(devices[int(env.get("LOCAL_RANK", env.get("SLURM_LOCALID", 0)))]), \
        "Lightning's root_device is parallel_devices[local_rank]"
    bound = devices != tuple(f"cuda:{r}" for r in range(len(devices)))
    try:  # what Lightning's DeepSpeed checks in fit(), after the data and the model are built
        _validate_device_index_selection([torch.device(d) for d in devices])
        accepted = True
    except RuntimeError:
        accepted = False
    assert accepted is not bound and (strategy_refused("deepspeed_stage_2", plan) is None) is accepted
    assert strategy_refused("ddp", plan) is None and strategy_refused("fsdp", plan) is None
    if bound:
        assert "without GPU binding" in strategy_refused("deepspeed_stage_2", plan)


def test_a_task_bound_to_several_gpus_is_refused_to_a_framework_that_cannot_tell_which_is_its():
    """--gpu-bind=closest on a node with two GPUs a socket: two tasks see the same two GPUs."""
    with pytest.raises(PlacementError, match="single:1"):
        node_device("auto", 4, 2, 1, bound=True)
    assert node_device("cuda:1", 4, 2, 1, bound=True) == "cuda:1"  # named: taken as asked


def test_lightning_starting_its_own_ranks_puts_rank_r_on_gpu_r():
    plan = plan_launch("auto", 2, None, gpus_visible=2, env={})
    assert plan.parallel_devices == ("cuda:0", "cuda:1") and plan.device == torch.device("cuda:0")
    # the rank Lightning starts runs the script again with LOCAL_RANK set: it plans GPU 1 for itself
    assert plan_launch("auto", 2, None, gpus_visible=2, env={"LOCAL_RANK": "1"}).device == torch.device("cuda:1")


def test_lightning_with_two_tasks_on_one_unbound_gpu_runs_on_the_cpu_or_stops():
    env = {**SRUN_2x2, "SLURM_LOCALID": "1"}
    plan = plan_launch("auto", None, None, gpus_visible=1, env=env)
    assert plan.accelerator == "cpu" and plan.device == torch.device("cpu") and "gloo" in plan.note
    with pytest.raises(LaunchMismatch, match="start at most one rank per GPU"):
        plan_launch("cuda", None, None, gpus_visible=1, env=env)


@pytest.mark.parametrize("nvml, torch_sees, cuda, said", [
    (4, False, "13.0", "CUDA 13.0) cannot use them: the NVIDIA driver is probably older"),
    (2, False, None, "CPU-only build"),
    (2, True, "13.0", ""),
    (0, False, "13.0", ""),
])
def test_gpus_torch_cannot_use_are_named_with_the_reason(nvml, torch_sees, cuda, said):
    note = cuda_unusable_note(nvml, torch_sees, cuda)
    assert (said in note) and bool(note) == bool(said)


# the two A100s of an FT3 node, as CUDA reports them: UUID (bare, as torch writes it), PCI address, name
U0, U1 = "6f3e1d2c-0a4b-4c5d-8e9f-0123456789ab", "9a8b7c6d-5e4f-4a3b-8c2d-1e0f9a8b7c6d"
A100_0 = VisibleGpu(U0, "0000:07:00", "NVIDIA A100-SXM4-40GB")
A100_1 = VisibleGpu(U1, "0000:0f:00", "NVIDIA A100-SXM4-40GB")


def _slice(uuid, gpu):
    """A MIG slice of ``gpu``: its own UUID, its GPU's PCI address."""
    return VisibleGpu(uuid, gpu.pci, gpu.name + " MIG 3g.20gb")


@pytest.mark.parametrize("visible, placed", [
    (f"GPU-{U1}", ["cuda:0", "cuda:0"]),  # rank 1 bound to the other GPU (by UUID): both on NCCL, no clash
    ("1", ["cuda:0", "cuda:0"]),          # the same, by index
    (f"GPU-{U0[:8]}", None),              # rank 1 bound to rank 0's GPU, by a UUID prefix: a clash
])
def test_a_rank_s_gpus_are_what_cuda_opened_whatever_cuda_visible_devices_called_them(visible, placed):
    """Rank 0 sees the node's two GPUs (torchrun); rank 1 was given one through CUDA_VISIBLE_DEVICES. What the
    ranks compare is the UUID CUDA reports for the device it opened, not the variable's spelling."""
    rank1_sees = {f"GPU-{U1}": [A100_1], "1": [A100_1], f"GPU-{U0[:8]}": [A100_0]}[visible]
    views = [RankView("c7-1", gpu_ids([A100_0, A100_1], None)), RankView("c7-1", gpu_ids(rank1_sees, visible))]
    assert views[0].gpus == (U0, U1)
    if placed is None:
        with pytest.raises(PlacementError, match="ranks 0 and 1 would share one GPU"):
            place_ranks(views, "cuda")
    else:
        assert [(p.device, p.backend) for p in place_ranks(views, "cuda")] == [(d, "nccl") for d in placed]


@pytest.mark.parametrize("visible", ["MIG-1b2c3d4e-5f60-5a1b-9c2d-3e4f5a6b7c8d", "0"])  # "0": Slurm renumbered
def test_ranks_on_mig_slices_of_one_gpu_never_share_it_through_nccl(visible):
    """Two ranks, each on a MIG slice of the same A100 (each slice its own UUID): to NCCL they are one GPU.
    Slices of two GPUs are two GPUs."""
    a = _slice("1b2c3d4e-5f60-5a1b-9c2d-3e4f5a6b7c8d", A100_0)
    b = _slice("2c3d4e5f-6071-5b2c-8d3e-4f5a6b7c8d9e", A100_0)
    same_gpu = [RankView("portal", gpu_ids([s], visible)) for s in (a, b)]
    assert same_gpu[0] == same_gpu[1]
    with pytest.raises(PlacementError, match="share one GPU|only 1 GPU"):
        place_ranks(same_gpu, "cuda")
    assert {p.backend for p in place_ranks(same_gpu)} == {"gloo"}
    other = _slice("3d4e5f60-7182-5c3d-9e4f-5a6b7c8d9eaf", A100_1)
    two_gpus = [RankView("portal", gpu_ids([s], visible)) for s in (a, other)]
    assert [p.device for p in place_ranks(two_gpus, "cuda")] == ["cuda:0", "cuda:0"]


def test_local_view_reads_each_visible_gpu_from_cuda(monkeypatch):
    """local_view's GPU branch, CUDA's answers given: one entry per device, in index order."""
    from course_utils import devices

    gpus = [A100_0, A100_1]
    pci = [(0, 0x07, 0), (0, 0x0F, 0)]

    def props(i):
        domain, bus, device = pci[i]
        return types.SimpleNamespace(uuid=gpus[i].uuid, name=gpus[i].name, pci_domain_id=domain, pci_bus_id=bus,
                                     pci_device_id=device)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert devices.local_view().gpus == (U0, U1)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "MIG-1b2c3d4e-5f60-5a1b-9c2d-3e4f5a6b7c8d")
    assert devices.local_view().gpus == ("pci 0000:07:00", "pci 0000:0f:00")


def test_auto_on_a_node_whose_driver_torch_cannot_use_says_why(monkeypatch, capsys):
    from course_utils import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the runtime fails ...
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)      # ... where NVML counts two GPUs
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices, "_warned_unusable", False)
    assert devices.local_view().gpus == ()
    assert "2 GPU(s) but torch (built for CUDA 13.0) cannot use them" in capsys.readouterr().err


# Run in a fresh Python: torch's record of a touched CUDA runtime is sticky, and this process may have one.
FORK_PROBE = r"""
import json, os, sys
import torch
# the hardware fact: the GPUs NVML counts on the node (there is no NVML here); nothing else of torch is replaced
torch.cuda._raw_device_count_nvml = lambda: int(os.environ["PROBE_NVML_GPUS"])
from course_utils import sizing

def child_can_use_cuda():
    # torch's own verdict: once the CUDA runtime was touched (cudaGetDeviceCount, cuInit), a forked child
    # starts "in bad fork" and its first CUDA call raises. Touched or not, this needs no GPU.
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.write(w, b"0" if torch.cuda._is_in_bad_fork() else b"1")
        os._exit(0)
    os.waitpid(pid, 0)
    return os.read(r, 1) == b"1"

steps = []
for nvml, visible in [("0", None), ("2", None), ("0", "MIG-4f1c7c8e-3b7d-5e0a-9a5b-0d5b6c1e2f3a")]:
    os.environ["PROBE_NVML_GPUS"] = nvml
    if visible is None:
        os.environ.pop("CUDA_VISIBLE_DEVICES", None)
    else:
        os.environ["CUDA_VISIBLE_DEVICES"] = visible
    steps.append([sizing.current_profile(), sizing.pick(ci=1, full=2, device="cpu"), child_can_use_cuda(),
                  torch.cuda.is_initialized()])
torch.cuda.is_available()  # what the profile must not call: the probe has to see it
print(json.dumps({"steps": steps, "probe_sees_a_runtime_call": not child_can_use_cuda()}))
"""


def test_the_profile_is_chosen_without_starting_cuda():
    """A notebook kernel picks its sizes before it forks ranks (notebook 06's ddp_notebook); a kernel that has
    touched the CUDA runtime forks children whose first CUDA call fails.

    Proves, with torch's real code and its own record (``torch.cuda._is_in_bad_fork`` in a forked child):
    ``current_profile`` and ``pick`` reach no CUDA runtime call (``is_available``, ``init``, a tensor on the GPU,
    or ``device_count`` falling back to the runtime) on a node whose NVML counts 0 or 2 GPUs, nor on a MIG slice,
    which NVML cannot count. Only NVML's count is given; the last step checks that the probe does see a runtime
    call. Cannot prove: what a real driver does inside NVML, or the machines without NVML (such as this one),
    where torch's ``device_count`` itself asks the runtime (harmless without a driver: no GPU for a child to lose).
    """
    import json
    import subprocess
    import sys

    from course_utils.paths import REPO_ROOT

    env = {k: v for k, v in os.environ.items() if k not in ("COURSE_PROFILE", "CUDA_VISIBLE_DEVICES")}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO_ROOT / "notebooks"), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", FORK_PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["probe_sees_a_runtime_call"], "the probe cannot tell: it proves nothing"
    # [profile, pick(ci=1, full=2, device="cpu"), a forked child can use CUDA, torch.cuda.is_initialized()]
    assert seen["steps"] == [["ci", 1, True, False],    # NVML: no GPU
                             ["full", 1, True, False],  # NVML: 2 GPUs; a demo moved to the CPU gets CPU sizes
                             ["full", 1, True, False]]  # a MIG slice


def test_the_environment_report_leaves_cuda_to_a_subprocess(monkeypatch):
    """On a GPU node (here: NVML's count said 1) the report's GPU facts come from a child Python,
    so the kernel can still fork; the child, shown no GPU, finds none, and says so (on any machine: on the
    H200 a child that was not told found its GPU)."""
    from course_utils.hardware import environment_report

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # the child's view; the kernel's NVML count is faked below
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "is_available", _forbidden("torch.cuda.is_available in the kernel"))
    monkeypatch.setattr(torch.cuda, "get_device_properties", _forbidden("get_device_properties in the kernel"))
    report = environment_report()
    assert report["cuda_available"] is False and report["gpus"] == []
    assert not torch.cuda.is_initialized()


def test_tf32_is_switched_with_the_api_torch_reads_and_read_back_without_error():
    before = tf32_state()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # allow_tf32 warns since torch 2.9
        try:
            set_tf32(True)
            assert tf32_state() == {"matmul": True, "conv": True}
            if hasattr(torch.backends.cuda.matmul, "fp32_precision"):
                assert torch.backends.cuda.matmul.fp32_precision == "tf32"
            # what Lightning reads on every Ampere or later GPU at fit(): it raised after fp32_precision = "tf32"
            assert torch.get_float32_matmul_precision() == "high"
            set_tf32(False)
            assert tf32_state() == {"matmul": False, "conv": False}
            from course_utils.hardware import environment_report

            assert environment_report()["flags"]["tf32 in fp32 matmuls"] is False  # the old getters raised here
        finally:
            set_tf32(None)
    assert tf32_state() == before == {"matmul": False, "conv": True}


def test_deepspeed_s_variables_are_returned_not_set():
    from course_utils.sharding import deepspeed_env

    before = dict(os.environ)
    wanted = deepspeed_env(use_gpu=False, environ={})
    assert dict(os.environ) == before, "a notebook kernel's environment is not changed"
    assert wanted["DS_ACCELERATOR"] == "cpu" and wanted["WORLD_SIZE"] == "1"
    assert "DS_ACCELERATOR" not in deepspeed_env(use_gpu=True, environ={})
    env_bin = str(Path(sys.executable).parent)
    under_torchrun = deepspeed_env(use_gpu=True, environ={"WORLD_SIZE": "2", "TORCH_EXTENSIONS_DIR": "/x",
                                                          "PATH": f"{env_bin}:/usr/bin"})
    assert under_torchrun == {}, "what the launcher set is kept"
    # the ops are built by this environment's ninja, whichever way the script was started
    assert wanted["PATH"] == env_bin and deepspeed_env(False, {"PATH": f"/usr/bin:{env_bin}"})["PATH"] == \
        f"{env_bin}:/usr/bin"


def test_temporary_env_gives_the_kernel_its_environment_back(monkeypatch):
    from course_utils.launch import temporary_env

    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    with temporary_env({"DS_ACCELERATOR": "cpu", "MASTER_PORT": "999"}):
        assert os.environ["DS_ACCELERATOR"] == "cpu" and os.environ["MASTER_PORT"] == "999"
    assert "DS_ACCELERATOR" not in os.environ and os.environ["MASTER_PORT"] == "1234"


def test_zero_offload_pins_its_cpu_memory_on_a_gpu_node_only():
    from course_utils.config import TrainConfig
    from course_utils.sharding import ds_config

    def pinned(use_gpu):
        config = ds_config(TrainConfig(), 2, 2, "bf16", offload=True, use_gpu=use_gpu)
        return config["zero_optimization"]["offload_optimizer"]["pin_memory"]
    assert pinned(True) is True and pinned(False) is False


@pytest.mark.parametrize("requested, resolved, runs, said", [
    ("amp", "fp16", "fp32", "no bf16"),   # Frontera's RTX 5000: a one-line fallback
    ("amp", "bf16", "bf16", ""),
    ("fp32", "fp32", "fp32", ""),
])
def test_fsdp_on_a_gpu_without_bf16_falls_back_to_fp32_and_says_so(requested, resolved, runs, said):
    from course_utils.sharding import fsdp_precision

    precision, note = fsdp_precision(requested, resolved)
    assert precision == runs and (said in note) and bool(note) == bool(said)


def test_fsdp_fp16_asked_for_by_name_is_refused():
    from course_utils.sharding import fsdp_precision

    with pytest.raises(ValueError, match="sharded gradient scaler"):
        fsdp_precision("fp16", "fp16")


@pytest.mark.parametrize("config, gpu, device", [
    ("nccl", 1, "cuda:1"),                # rank 1 of a node under Lightning or Ray Train: its own GPU, not GPU 0
    ("cpu:gloo,cuda:nccl", 3, "cuda:3"),  # init_process_group() without a backend, on a GPU node
    ("gloo", 1, "cpu"),                   # a gloo group on a GPU node moves CPU tensors
    ("cpu:gloo,cuda:nccl", None, "cpu"),  # the same default on a machine without a GPU
])
def test_a_group_formed_elsewhere_gives_the_rank_s_gpu_under_nccl_and_the_cpu_under_gloo(config, gpu, device):
    from course_utils.process_group.group import group_device

    assert group_device(config, gpu) == torch.device(device)


@pytest.mark.parametrize("config, bound, current_gpu, expected", [
    (None, None, None, "cpu"),                   # this machine's own group and facts: nothing given
    (None, None, 1, "cpu"),                      # gloo on a GPU node (no NCCL group can form here)
    ("nccl", None, 1, "cuda:1"),                 # the framework set this rank's GPU
    ("cpu:gloo,cuda:nccl", None, 1, "cuda:1"),   # init_process_group() without a backend on a GPU node
    ("nccl", 2, 0, "cuda:2"),                    # bound with device_id=cuda:2 but never set_device: not GPU 0
])
def test_an_existing_group_keeps_its_device(monkeypatch, config, bound, current_gpu, expected):
    """init_distributed inside a group formed elsewhere (Ray Train, Lightning, a script's own
    init_process_group()) answers that group's device. The group is real (gloo); where an NCCL group is
    the case, its backend and bound GPU are given, with this rank's current GPU."""
    import torch.distributed as dist

    from course_utils.process_group import init_distributed

    dist.init_process_group(None, store=dist.HashStore(), rank=0, world_size=1)
    try:
        if config is not None:
            monkeypatch.setattr(dist, "get_backend_config", lambda group=None: config)
        if bound is not None:
            group = dist.distributed_c10d._get_default_group()
            monkeypatch.setattr(group, "bound_device_id", torch.device("cuda", bound))
        if current_gpu is not None:
            monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)  # would have chosen cuda:0 before
            monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
            monkeypatch.setattr(torch.cuda, "current_device", lambda: current_gpu)
        _, device = init_distributed("auto")
        assert device == torch.device(expected)
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# The door: no script under scripts/ forms a process group or picks a device itself
# --------------------------------------------------------------------------- #
# Calls that form a group or choose a device: only course_utils.process_group (init_distributed,
# session) and lit.plan_launch make them. deepspeed.init_distributed is allowed: it wraps the group
# the door formed. A launcher that starts ranks but joins none may count GPUs to size its runs.
AROUND_THE_DOOR = {"init_process_group", "set_device", "device_count", "is_available", "is_bf16_supported",
                   "node_device", "place_ranks", "get_device_capability"}
COUNTS_GPUS_TO_LAUNCH = {"benchmark_ddp.py": {"device_count"}}  # starts torchrun runs, is never a rank itself
USERS_OWN = ("plain_ddp.py", "plain_resumable.py", "plain_fsdp.py")  # the researcher's own: no course_utils, set_device before the group
HOROVOD_OWN = "plain_horovod.py"  # the same script in Horovod (hvd.init, then set_device); not run here
SINGLE_OWN = "plain_single.py"  # the one-device script plain_ddp.py makes distributed (notebook 03's diff): no group
FABRIC_OWN = "plain_fabric.py"  # plain_ddp.py in Fabric (notebook 06's diff): fabric.launch() sets the GPU and the group
LIGHTNING_OWN = "plain_lightning.py"  # plain_ddp.py as a LightningModule (notebook 06 §3): the Trainer sets them


def _calls(path):
    import ast

    tree = ast.parse(path.read_text(), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
            yield name, node.lineno


def test_every_script_gets_its_device_and_group_through_the_door():
    from course_utils.paths import SCRIPTS

    around = {}
    for path in sorted(SCRIPTS.glob("*.py")):
        if path.name in (*USERS_OWN, HOROVOD_OWN, SINGLE_OWN, FABRIC_OWN, LIGHTNING_OWN):
            continue
        allowed = COUNTS_GPUS_TO_LAUNCH.get(path.name, set())
        bad = [f"{name}() line {line}" for name, line in _calls(path) if name in AROUND_THE_DOOR - allowed]
        if bad:
            around[path.name] = bad
    assert not around, ("these scripts choose a device or form a process group themselves; use "
                        f"course_utils.process_group.init_distributed or lit.plan_launch: {around}")


class _GroupFormed(Exception):
    pass


def run_until_the_group_forms(script, monkeypatch, gpus, local_rank):
    """Run ``script`` as rank ``local_rank`` of a 2-rank torchrun job on a node whose process sees ``gpus`` GPUs,
    up to its process group: the calls to ``set_device`` and ``init_process_group`` in order (neither can run
    here: no GPU, no NCCL), and the message it exits with, if any."""
    import runpy
    import sys

    import torch.distributed as dist

    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: gpus > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: gpus)

    def set_device(device):
        calls.append(("set_device", torch.device("cuda", device) if isinstance(device, int) else torch.device(device)))

    def init_process_group(backend=None, **kwargs):
        calls.append(("init_process_group", backend, kwargs.get("device_id")))
        raise _GroupFormed  # what follows needs the group and the GPU

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "init_process_group", init_process_group)
    monkeypatch.setattr(dist, "TCPStore", lambda *args, **kwargs: None)  # plain_resumable.py's own store: no server
    monkeypatch.setattr(dist, "PrefixStore", lambda prefix, store: None)
    monkeypatch.setattr(sys, "argv", [str(script), "--epochs", "1"])
    for name, value in {"LOCAL_RANK": local_rank, "RANK": local_rank, "WORLD_SIZE": 2, "LOCAL_WORLD_SIZE": 2,
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": 29500}.items():
        monkeypatch.setenv(name, str(value))
    handler = signal.getsignal(signal.SIGUSR1)  # plain_resumable.py installs its own: this process keeps pytest's
    try:
        runpy.run_path(str(script), run_name="__main__")
    except _GroupFormed:
        return calls, None
    except SystemExit as stop:
        return calls, str(stop.code)
    finally:
        signal.signal(signal.SIGUSR1, handler)
    raise AssertionError(f"{script} ended without forming a process group")


@pytest.mark.parametrize("name", USERS_OWN)
def test_the_users_own_script_sets_its_gpu_before_its_group(monkeypatch, name):
    """plain_ddp.py (and plain_resumable.py) run as rank 1 on a 2-GPU node: its GPU is set, then the group formed
    with NCCL and that GPU as device_id (set later, NCCL's communicator and the first allocations land on GPU 0 of
    every rank)."""
    import ast

    from course_utils.paths import SCRIPTS

    script = SCRIPTS / name
    monkeypatch.syspath_prepend(str(SCRIPTS))  # as `python scripts/<name>` has it: plain_parts beside it
    imported = {(node.module or "") if isinstance(node, ast.ImportFrom) else alias.name
                for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, (ast.Import, ast.ImportFrom))
                for alias in node.names}
    assert not [m for m in imported if m.split(".")[0] == "course_utils"], "it stays the user's: plain torch"
    cuda1 = torch.device("cuda", 1)
    assert run_until_the_group_forms(script, monkeypatch, gpus=2, local_rank=1) == (
        [("set_device", cuda1), ("init_process_group", "nccl", cuda1)], None)
    assert run_until_the_group_forms(script, monkeypatch, gpus=0, local_rank=1) == (
        [("init_process_group", "gloo", None)], None)
    calls, said = run_until_the_group_forms(script, monkeypatch, gpus=1, local_rank=1)
    assert calls == [] and "LOCAL_RANK=1 but this process sees 1 GPU(s)" in said, "never two NCCL ranks on one GPU"


def test_the_horovod_script_is_valid_python_and_sets_its_gpu_before_using_it():
    """plain_horovod.py is shown, not run (no Horovod builds against this torch): it must at least parse,
    stay free of course_utils, and set its GPU from hvd.local_rank() before its first allocation."""
    from course_utils.paths import SCRIPTS

    path = SCRIPTS / HOROVOD_OWN
    compile(path.read_text(), str(path), "exec")
    text = path.read_text()
    assert "course_utils" not in text
    calls = {}
    for name, line in _calls(path):
        calls[name] = min(line, calls.get(name, line))
    assert calls["init"] < calls["set_device"] < calls["build_model"], "hvd.init, then the GPU, then the model"


def test_a_pipeline_stage_waits_for_its_own_stream_not_the_whole_gpu(monkeypatch):
    """torch's interleaved 1F1B posts the receives of later micro-batches early, on NCCL's streams: a
    device-wide synchronize would wait for them too (for the neighbour's unrelated compute) and inflate the
    bubble notebook 09 measures; the stage waits for the stream its input was ordered on."""
    from course_utils import pipeline

    synchronized = []
    monkeypatch.setattr(torch.cuda, "synchronize", _forbidden("torch.cuda.synchronize (every stream of the GPU)"))
    monkeypatch.setattr(torch.cuda, "current_stream",
                        lambda device=None: types.SimpleNamespace(synchronize=lambda: synchronized.append(device)))
    pipeline.block_until_ready(types.SimpleNamespace(device=torch.device("cuda:1")))
    assert synchronized == [torch.device("cuda:1")]
    pipeline.block_until_ready(torch.zeros(1))  # gloo's wait() has blocked the CPU already
    assert synchronized == [torch.device("cuda:1")]


def test_deepspeed_sets_the_gpu_the_course_placed_the_rank_on():
    """deepspeed.initialize calls set_device(int(LOCAL_RANK)): with Slurm binding a GPU to each task, task 1 of a
    node is on its own cuda:0 while LOCAL_RANK says 1."""
    from course_utils.sharding import deepspeed_device_env

    assert deepspeed_device_env(torch.device("cuda:0"), {"LOCAL_RANK": "1"}) == {"LOCAL_RANK": "0"}  # bound
    assert deepspeed_device_env(torch.device("cuda:1"), {"LOCAL_RANK": "1"}) == {}  # torchrun: rank k on GPU k
    assert deepspeed_device_env(torch.device("cpu"), {"LOCAL_RANK": "1"}) == {}
