"""The CUDA branches, tested on a CPU machine with the hardware facts as input.

Each test gives the facts a GPU node would show (compute capability, visible GPUs, Slurm's
binding, a driver torch cannot use) and checks the decision the course makes from them: the
precision, each script family's device, and that nothing starts CUDA or changes the
environment where a notebook kernel calls it. Where a function reads ``torch.cuda`` itself,
``torch.cuda`` is given those facts with monkeypatch; the functions that must not touch the GPU
(``is_bf16_supported``, ``is_available`` in a kernel) are replaced by ones that fail the test.
"""

from __future__ import annotations

import os
import types
import warnings

import pytest
import torch

from course_utils.devices import PlacementError, cuda_unusable_note, gpus_bound, node_device
from course_utils.lit import LaunchMismatch, plan_launch
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
    ({"SLURM_GPU_BIND": "closest"}, True),          # COURSE_GPU_BIND=closest in course_job.sh
    ({"SLURM_GPU_BIND": "map_gpu:0,1"}, True),
    ({"SLURM_GPU_BIND": "none"}, False),
    ({"SLURM_GPU_BIND": "none,verbose"}, False),
])
def test_slurm_gpu_binding_is_read_from_the_task_s_environment(env, bound):
    assert gpus_bound(env) is bound


SRUN_2x2 = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
            "SLURM_STEP_NUM_TASKS": "4"}


@pytest.mark.parametrize("env, gpus, devices", [
    ({**SRUN_2x2, "SLURM_LOCALID": "1"}, 2, ("cuda:1", "cuda:1")),  # every task sees both: GPU LOCALID
    ({**SRUN_2x2, "SLURM_LOCALID": "1", "SLURM_GPUS_PER_TASK": "1"}, 1, ("cuda:0", "cuda:0")),
    ({**SRUN_2x2, "SLURM_LOCALID": "1", "SLURM_GPU_BIND": "closest"}, 1, ("cuda:0", "cuda:0")),
    ({"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, 4, ("cuda:3",) * 4),
    ({}, 2, ("cuda:0",)),  # python train_lightning.py on a 2-GPU node: one process, one GPU
])
def test_lightning_and_fabric_get_this_rank_s_gpu_from_the_policy(env, gpus, devices):
    plan = plan_launch("auto", None, None, gpus_visible=gpus, env=env)
    assert plan.accelerator == "gpu" and plan.parallel_devices == devices
    assert plan.device == torch.device(devices[0]), "Lightning's root_device is parallel_devices[local_rank]"


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


def test_auto_on_a_node_whose_driver_torch_cannot_use_says_why(monkeypatch, capsys):
    from course_utils import devices

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # the runtime fails ...
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)      # ... where NVML counts two GPUs
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(devices, "_warned_unusable", False)
    assert devices.local_view().gpus == ()
    assert "2 GPU(s) but torch (built for CUDA 13.0) cannot use them" in capsys.readouterr().err


def test_the_profile_is_chosen_without_starting_cuda(monkeypatch):
    """A notebook kernel picks its sizes before it forks ranks (notebook 06's ddp_notebook)."""
    from course_utils import sizing

    monkeypatch.delenv("COURSE_PROFILE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", _forbidden("torch.cuda.is_available (initialises CUDA)"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # NVML's count
    assert sizing.current_profile() == "full"
    assert sizing.pick(ci=1, full=2, device="cpu") == 1


def test_the_environment_report_leaves_cuda_to_a_subprocess(monkeypatch):
    """On a GPU node (here: NVML's count said 1) the report's GPU facts come from a child Python,
    so the kernel can still fork; this machine's child then finds no usable GPU, and says so."""
    from course_utils.hardware import environment_report

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
    under_torchrun = deepspeed_env(use_gpu=True, environ={"WORLD_SIZE": "2", "TORCH_EXTENSIONS_DIR": "/x"})
    assert under_torchrun == {}, "what the launcher set is kept"


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


def test_an_existing_group_keeps_its_device(monkeypatch):
    """init_distributed inside a group formed elsewhere (Ray Train, Lightning) answers that group's device."""
    import torch.distributed as dist

    from course_utils.dist import init_distributed

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # would have chosen cuda:0 before
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        _, device = init_distributed("auto")
        assert device == torch.device("cpu")
    finally:
        dist.destroy_process_group()


# --------------------------------------------------------------------------- #
# The door: no script under scripts/ forms a process group or picks a device itself
# --------------------------------------------------------------------------- #
# Calls that form a group or choose a device: only course_utils.dist (init_distributed,
# session) and lit.plan_launch make them. deepspeed.init_distributed is allowed: it wraps the group
# the door formed. A launcher that starts ranks but joins none may count GPUs to size its runs.
AROUND_THE_DOOR = {"init_process_group", "set_device", "device_count", "is_available", "is_bf16_supported",
                   "node_device", "place_ranks", "get_device_capability"}
COUNTS_GPUS_TO_LAUNCH = {"benchmark_ddp.py": {"device_count"}}  # starts torchrun runs, is never a rank itself
USERS_OWN = "plain_ddp.py"  # the researcher's own script: no course_utils, but set_device before the group
HOROVOD_OWN = "plain_horovod.py"  # the same script in Horovod (hvd.init, then set_device); not run here


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
        if path.name in (USERS_OWN, HOROVOD_OWN):
            continue
        allowed = COUNTS_GPUS_TO_LAUNCH.get(path.name, set())
        bad = [f"{name}() line {line}" for name, line in _calls(path) if name in AROUND_THE_DOOR - allowed]
        if bad:
            around[path.name] = bad
    assert not around, ("these scripts choose a device or form a process group themselves; use "
                        f"course_utils.dist.init_distributed or lit.plan_launch: {around}")


def test_the_users_own_script_sets_its_gpu_before_its_group():
    from course_utils.paths import SCRIPTS

    calls = {}
    for name, line in _calls(SCRIPTS / USERS_OWN):
        calls[name] = min(line, calls.get(name, line))
    assert "import course_utils" not in (SCRIPTS / USERS_OWN).read_text() and "from course_utils" not in \
        (SCRIPTS / USERS_OWN).read_text(), "it stays the user's: plain torch"
    assert calls["set_device"] < calls["init_process_group"], "torch.cuda.set_device before init_process_group"


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
    assert calls["init"] < calls["set_device"] < calls["Linear"], "hvd.init, then the GPU, then the model"
