"""Lightning and Fabric on the course's pieces: the launch checks and the refusals.

Notebook 06 runs the four trainers (train.py, ddp_loop.py, train_lightning.py, train_fabric.py)
on the same model, data and seed and checks that they reach the same loss, and resumes a
Lightning run; those checks live there. Here: what a notebook cannot show, the mistakes.
"""

import math
import os
import re
import shutil
import sys
from datetime import timedelta

import pytest
import torch

from course_utils.launch import run_command, run_script, start_script
from course_utils.lit import (LaunchMismatch, full_weights, latest_checkpoint, plan_launch, precision_args,
                              precision_refused, sharded_placement, strategy_refused)
from course_utils.precision import precision_for
import lightning as L
from lightning.pytorch.plugins.precision import FSDPPrecision
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy
from course_utils.paths import SCRIPTS

TINY = ["--model", "cnn", "--epochs", "2", "--n-train", "1024", "--n-val", "256", "--batch-size", "32",
        "--workers", "0", "--no-progress"]

SRUN_2x2 = {"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_JOB_NAME": "train",
            "SLURM_STEP_NUM_TASKS": "4"}


def layout(plan):
    return plan.accelerator, plan.devices, plan.num_nodes


def test_the_launcher_gives_devices_and_nodes():
    assert layout(plan_launch("auto", None, None, gpus_visible=2, env=SRUN_2x2)) == ("gpu", 2, 2)
    assert plan_launch("auto", 2, 2, gpus_visible=2, env=SRUN_2x2).launcher == "slurm"
    torchrun = {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "8"}
    assert layout(plan_launch("cpu", None, None, gpus_visible=4, env=torchrun)) == ("cpu", 4, 2)
    assert layout(plan_launch("auto", 2, None, gpus_visible=0, env={})) == ("cpu", 2, 1)  # Lightning starts them
    # compressed per-node counts, as Slurm writes them
    assert plan_launch("auto", None, None, gpus_visible=4, env={**SRUN_2x2, "SLURM_NTASKS_PER_NODE": "4(x2)",
                                                                "SLURM_NTASKS": "8"}).devices == 4


@pytest.mark.parametrize("devices, nodes, env, gpus, message", [
    (1, None, SRUN_2x2, 2, "--devices 1 but the job runs --ntasks-per-node=2 on --nodes=2: pass --devices 2"),
    (None, 1, SRUN_2x2, 2, "--num-nodes 1 but the job runs --ntasks-per-node=2 on --nodes=2: pass --num-nodes 2"),
    (2, None, {"LOCAL_WORLD_SIZE": "4", "WORLD_SIZE": "4"}, 4, "torchrun started 4 process(es) per node"),
    (None, None, {k: v for k, v in SRUN_2x2.items() if k != "SLURM_STEP_NUM_TASKS"}, 2, "not started by srun"),
    (None, None, {"SLURM_NTASKS": "4", "SLURM_NNODES": "2", "SLURM_STEP_NUM_TASKS": "4"}, 2,
     "request --ntasks-per-node=N"),
])
def test_a_layout_lightning_would_hang_or_fail_on_is_one_error(devices, nodes, env, gpus, message):
    with pytest.raises(LaunchMismatch, match=re.escape(message)):
        plan_launch("auto", devices, nodes, gpus_visible=gpus, env=env)


def test_too_few_gpus_is_an_error_on_cuda_and_the_cpu_on_auto():
    with pytest.raises(LaunchMismatch, match="2 ranks on this node but 1 GPU"):
        plan_launch("cuda", 2, None, gpus_visible=1, env={})
    plan = plan_launch("auto", 2, None, gpus_visible=1, env={})
    assert plan.accelerator == "cpu" and "gloo" in plan.note


@pytest.mark.parametrize("script", ["train_lightning.py", "train_fabric.py"])
def test_a_flag_the_script_leaves_out_is_named(script):
    run = run_command([sys.executable, str(SCRIPTS / script), *TINY, "--channels-last"], timeout_s=120, check=False,
                      echo=False)
    assert run.returncode != 0 and "does not implement --channels-last" in run.output, run.output
    assert "Traceback" not in run.output


def test_lightning_refuses_to_resume_another_configuration_or_an_unreadable_checkpoint(tmp_path):
    """(Notebook 06 resumes a run and reads its TensorBoard log across both; here: the refusals, in one line.)"""
    run_script("train_lightning.py", [*TINY, "--epochs", "1", "--ckpt-dir", str(tmp_path / "run")], echo=False)
    assert latest_checkpoint(tmp_path / "run") == str(tmp_path / "run" / "last.ckpt")
    shutil.copytree(tmp_path / "run", tmp_path / "cut")
    last = tmp_path / "cut" / "last.ckpt"
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short, a full quota
    # the two refusals at once, each on a core of its own
    other = start_script("train_lightning.py", [*TINY, "--epochs", "3", "--batch-size", "16", "--ckpt-dir",
                                                str(tmp_path / "run")])
    broken = start_script("train_lightning.py", [*TINY, "--epochs", "2", "--ckpt-dir", str(tmp_path / "cut")])
    other, broken = other.wait(check=False), broken.wait(check=False)
    assert other.returncode == 2 and "written by another configuration (batch_size 32 -> 16)" in other.output
    assert "Traceback" not in other.output
    assert broken.returncode == 2 and "Traceback" not in broken.output, broken.output
    assert f"the checkpoint {last} is unreadable" in broken.output and "no readable checkpoint" in broken.output


def test_a_lightning_run_stopped_mid_epoch_resumes_with_the_batches_the_epoch_had_left(tmp_path):
    """Slurm's warning mid-epoch, then the requeued run: it ends on the uninterrupted run's validation loss, to
    the bit, so it trained the same batches in the same order (Lightning restores the DataModule's
    StatefulDataLoader from last.ckpt; a plain DataLoader would start the epoch over). One process, one
    thread, fp32: the same arithmetic in both."""
    import signal

    from course_utils.results import parse_result
    from course_utils.waiting import wait_until
    from references import ONE_THREAD, RESUME_ARGS

    straight = start_script("train_lightning.py", RESUME_ARGS, env=ONE_THREAD)
    ckpt = tmp_path / "stopped"
    args = [*RESUME_ARGS, "--ckpt-dir", str(ckpt)]
    job = start_script("train_lightning.py", args, env=ONE_THREAD)
    # epoch 0's last.ckpt is written after its last step: the warning lands inside epoch 1
    wait_until(lambda: (ckpt / "last.ckpt").exists() or not job.running(), 300,
               lambda: AssertionError(job.output[-3000:]), interval_s=0.02)
    os.kill(job.proc.pid, signal.SIGUSR1)  # plain python: the script itself
    first = parse_result(job.wait(timeout_s=300).output)
    assert first["stopped"] and first["global_step"] % 48 != 0, first  # 1536 / 32: 48 steps an epoch
    second = parse_result(run_script("train_lightning.py", args, env=ONE_THREAD, timeout_s=600, echo=False).output)
    reference = parse_result(straight.wait(timeout_s=600).output)
    assert second["resumed_at_step"] == first["global_step"] and not second["stopped"]
    assert second["global_step"] == reference["global_step"] == 4 * 48
    assert second["val_loss"] == reference["val_loss"], (second, reference)


def test_the_loop_by_hand_never_puts_two_ranks_on_one_gpu():
    """More ranks on a node than GPUs: --device cuda stops in one line. (What --device auto does then, every
    rank on the CPU in one gloo group, is the device policy's, tested with the hardware as input in
    tests/test_devices.py; notebook 06 runs the loop by hand on the CPU.)"""
    gpus = torch.cuda.device_count()
    run = run_script("ddp_loop.py", [*TINY, "--epochs", "1", "--device", "cuda"], nproc=gpus + 1, timeout_s=120,
                     check=False, echo=False)
    said = "no CUDA GPU is visible" if gpus == 0 else f"{gpus + 1} ranks on .* but only {gpus} GPU"
    assert run.returncode != 0 and re.search(said, run.output), run.output


GPU_2 = {"LOCAL_WORLD_SIZE": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


@pytest.mark.parametrize("strategy", ["fsdp", "fsdp2", "deepspeed_stage_2"])
def test_a_sharded_strategy_gets_the_rank_s_gpu_and_is_refused_in_one_line_without_one(strategy):
    """On GPUs the strategy is handed the devices of the course's policy (local rank 1 on cuda:1); on a
    CPU, where Lightning 2.6 refuses FSDP1 and DeepSpeed, one line names what shards there; FSDP2
    (ModelParallelStrategy, one data-parallel dimension over every rank) is not refused (notebook 06 runs it)."""
    gpu = plan_launch("auto", None, None, gpus_visible=2, env=GPU_2)
    assert strategy_refused(strategy, gpu) is None
    made = sharded_placement(strategy, gpu, timedelta(seconds=60))["strategy"]
    assert made.parallel_devices[gpu.local_rank] == gpu.device == torch.device("cuda:1")  # its root_device
    kind = {"fsdp": FSDPStrategy, "fsdp2": ModelParallelStrategy, "deepspeed_stage_2": DeepSpeedStrategy}[strategy]
    assert isinstance(made, kind)
    cpu = plan_launch("auto", None, None, gpus_visible=0, env=GPU_2)
    refusal = strategy_refused(strategy, cpu)
    if strategy == "fsdp2":
        assert refusal is None and (made._data_parallel_size, made._tensor_parallel_size) == (2, 1)
    else:
        assert "CUDA GPUs only" in refusal and ("fsdp2" if strategy == "fsdp" else "train_deepspeed.py") in refusal
    assert "choose one of ddp, fsdp, fsdp2" in strategy_refused("fsdp3", gpu)


def test_fsdp2_refuses_fp16_in_one_line_and_takes_fp32_and_bf16():
    """Lightning's ModelParallelStrategy refuses "16-mixed" (read in its accelerator connector): train_lightning.py
    says so before anything is built; Frontera's RTX 5000 resolves amp to fp16 there, FT3's A100 to bf16."""
    assert "--precision fp32" in precision_refused("fsdp2", "fp16")
    assert precision_refused("fsdp2", "bf16") is None and precision_refused("fsdp2", "fp32") is None
    assert precision_refused("ddp", "fp16") is None and precision_refused("deepspeed_stage_2", "fp16") is None
    with pytest.raises(ValueError, match="ModelParallelStrategy"):  # Lightning's own refusal, later and longer
        L.Trainer(accelerator="cpu", devices=1, strategy=ModelParallelStrategy(), precision="16-mixed", logger=False)


TURING, AMPERE = (7, 5), (8, 0)  # Frontera's RTX 5000, FT3's A100


def fsdp_config(capability: tuple[int, int], ours: bool = True):
    """The ``MixedPrecision`` Lightning hands ``FullyShardedDataParallel`` for ``--precision amp`` on a GPU of
    ``capability``: from the course's strategy (``ours``) or from Lightning's defaults (the Trainer sets the
    FSDP precision plugin on the strategy from ``precision=``)."""
    lightning, kwargs = precision_args("fsdp", precision_for("amp", "cuda", capability))
    gpu = plan_launch("auto", None, None, gpus_visible=2, env=GPU_2)
    made = sharded_placement("fsdp", gpu, timedelta(seconds=60), **(kwargs if ours else {}))["strategy"]
    made.precision_plugin = FSDPPrecision(lightning)
    return lightning, made


@pytest.mark.filterwarnings("ignore:.*GradScaler is enabled, but CUDA")  # FSDPPrecision("16-mixed") on a CPU
@pytest.mark.parametrize("capability, lightning, low", [(TURING, "16-mixed", torch.float16),
                                                        (AMPERE, "bf16-mixed", torch.bfloat16)])
def test_fsdp_keeps_weights_and_batch_norm_statistics_in_fp32_at_the_gpu_s_precision(capability, lightning, low):
    """Issue 31, finding 3. The precision follows the compute capability (fp16 on Turing, bf16 from Ampere);
    FSDP gets its weights and buffers in fp32 whichever it is, where Lightning's own config casts both to
    16 bits and summon_full_params gives the weights back in fp32 but not the buffers."""
    name, made = fsdp_config(capability)
    assert name == lightning
    config = made.mixed_precision_config  # what FSDPStrategy.setup hands FullyShardedDataParallel
    assert (config.param_dtype, config.reduce_dtype, config.buffer_dtype) == (torch.float32,) * 3
    assert fsdp_config(capability, ours=False)[1].mixed_precision_config.buffer_dtype == low  # Lightning's: why
    for other in ("ddp", "deepspeed_stage_2"):  # nothing but the precision's name for them
        assert precision_args(other, precision_for("amp", "cuda", capability)) == (lightning, {})
    with pytest.raises(ValueError, match="resolve it first"):
        precision_args("fsdp", "amp")


@pytest.mark.filterwarnings("ignore:.*GradScaler is enabled, but CUDA", "ignore:.*switching to use `NO_SHARD`")
@pytest.mark.parametrize("ours", [True, False], ids=["course", "lightning-default"])
def test_evaluating_after_fsdp_meets_batch_norm_in_one_dtype(one_rank_group, ours):
    """Finding 3's failure, on a CPU (Lightning's Trainer refuses FSDP there; torch's FSDP runs, one rank:
    NO_SHARD, which casts buffers the same way): the course's cnn wrapped by FSDP with the config Lightning
    would use on Frontera's Turing GPUs, one step, then train_lightning.py's evaluation (full_weights, the
    course's evaluate in fp16). Lightning's default leaves fp16 running statistics beside fp32 weights, which
    batch norm refuses; the course's keeps both in fp32."""
    import types

    from torch.distributed.fsdp import FullyShardedDataParallel

    from course_utils.models import build_model
    from course_utils.trainer import evaluate

    _, made = fsdp_config(TURING, ours)
    torch.manual_seed(0)
    model = build_model("cnn", 3, 10, width=8)
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,)))
    made.model = FullyShardedDataParallel(model, mixed_precision=made.mixed_precision_config,
                                          device_id=torch.device("cpu"))
    made.model(data.tensors[0]).sum().backward()  # FSDP casts the buffers on the first forward
    with full_weights(types.SimpleNamespace(strategy=made)):
        statistics = {b.dtype for b in model.buffers() if b.is_floating_point()}
        assert {p.dtype for p in model.parameters()} == {torch.float32}  # summon_full_params: full precision
        loader, cpu = torch.utils.data.DataLoader(data, batch_size=4), torch.device("cpu")
        if ours:
            assert statistics == {torch.float32}
            assert all(map(math.isfinite, evaluate(model, loader, cpu, "fp16")))
        else:  # what train_lightning.py --strategy fsdp met after fit
            assert statistics == {torch.float16}
            with pytest.raises(RuntimeError, match="dtype|scalar type"):
                evaluate(model, loader, cpu, "fp16")



def test_a_rank_forked_from_a_kernel_that_computed_needs_one_thread():
    """GNU OpenMP after fork: a child that computes with the threads its parent used never finishes (on the
    H200's 16 cores Lightning gave each forked rank 8 threads and one died of SIGSEGV); after the callback
    notebook 06 gives its forked ranks, it does. Both forked from this process, with two threads each."""
    import os
    import time

    from course_utils.lit import OneThreadPerForkedRank

    threads = torch.get_num_threads()
    conv, x = torch.nn.Conv2d(3, 32, 3), torch.randn(64, 3, 64, 64)
    children, seen = {}, {}
    try:
        torch.set_num_threads(2)
        with torch.no_grad():
            conv(x)  # the kernel computed with two threads before it forked
        for how in ("callback", "inherited"):
            pid = os.fork()
            if pid == 0:
                if how == "callback":
                    OneThreadPerForkedRank().setup(None, None, "fit")  # what each forked rank runs first
                conv(x).sum().backward()
                os._exit(0)
            children[pid] = how
        deadline = time.monotonic() + 60
        while len(seen) < 2 and time.monotonic() < deadline:
            pid, _ = os.waitpid(-1, os.WNOHANG)
            if pid in children:
                seen[children[pid]] = "finished"
                deadline = min(deadline, time.monotonic() + 3)  # the other gets 3 s more
            time.sleep(0.05)
    finally:
        torch.set_num_threads(threads)
        for pid, how in children.items():
            if how not in seen:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
    assert seen == {"callback": "finished"}, seen


# what each launcher leaves in a rank's environment (the variables both readers look at)
LAUNCHER_ENVS = {
    "plain python": ({}, "none"),
    "torchrun": ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1"}, "torchrun"),
    "srun, 2 tasks a node": ({"SLURM_NTASKS": "4", "SLURM_NTASKS_PER_NODE": "2", "SLURM_NNODES": "2", "SLURM_LOCALID": "1",
                              "SLURM_STEP_NUM_TASKS": "4", "SLURM_JOB_NAME": "train"}, "slurm"),
    "python in a one-task batch job": ({"SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "train"}, "slurm"),
    "torchrun inside a Slurm job": ({"SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "lab",
                                     "TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}, "torchrun"),
    "an interactive allocation": ({"SLURM_NTASKS": "1", "SLURM_NNODES": "1", "SLURM_JOB_NAME": "interactive"}, "none"),
}


@pytest.mark.parametrize("case", LAUNCHER_ENVS, ids=str)
def test_plan_launch_reads_the_launcher_lightning_itself_detects(case, monkeypatch):
    """A contract with the installed Lightning: the launcher plan_launch checks the layout against is the cluster
    environment Lightning's own Trainer chooses (_AcceleratorConnector: TorchElastic first, then SLURM), so an
    upgrade that changes Lightning's detection fails here rather than on a cluster."""
    from types import SimpleNamespace

    from lightning.fabric.plugins.environments import LightningEnvironment, SLURMEnvironment, TorchElasticEnvironment
    from lightning.pytorch.trainer.connectors.accelerator_connector import _AcceleratorConnector

    env, ours = LAUNCHER_ENVS[case]
    for key in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_")) or k in ("WORLD_SIZE",
                                                                                             "LOCAL_WORLD_SIZE",
                                                                                             "LOCAL_RANK", "RANK")]:
        monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    chosen = _AcceleratorConnector._choose_and_init_cluster_environment(SimpleNamespace(_cluster_environment_flag=None))
    lightning = {TorchElasticEnvironment: "torchrun", SLURMEnvironment: "slurm", LightningEnvironment: "none"}[type(chosen)]
    assert plan_launch("cpu", None, None, gpus_visible=0).launcher == lightning == ours
