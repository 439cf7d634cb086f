"""The launch checks Lightning leaves to you: the layout of ranks against the launcher's, each rank's device
(:func:`plan_launch`), and which strategies run where."""

from __future__ import annotations

import argparse
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from ..devices import PlacementError, gpus_bound, node_device


# the course's precision names -> Lightning's and Fabric's
LIGHTNING_PRECISION = {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}
# train_lightning.py --strategy: the same LightningModule replicated (DDP) or sharded (notebook 07's ideas):
# FSDP1, FSDP2 (Lightning's ModelParallelStrategy, CourseModule.configure_model) or DeepSpeed's ZeRO-2
STRATEGIES = ("ddp", "fsdp", "fsdp2", "deepspeed_stage_2")


class LaunchMismatch(ValueError):
    """The launcher's layout and the Trainer's arguments disagree; the message says what to change."""


@dataclass(frozen=True)
class LaunchPlan:
    """What the Lightning or Fabric launcher gets: the layout of ranks and this rank's device."""

    accelerator: str  # "gpu" or "cpu"
    devices: int  # ranks per node
    num_nodes: int
    launcher: str  # slurm | torchrun | none (Lightning starts the processes itself)
    note: str = ""
    # the device of each local rank, handed to the strategy (parallel_devices) so that Lightning does
    # not count GPUs itself: cuda:0 ... cuda:N-1 when every rank sees the node's GPUs; cuda:0 for each when
    # Slurm binds a GPU to each task (under a launcher Lightning reads this rank's entry only)
    parallel_devices: tuple[str, ...] = ()
    local_rank: int = 0  # this process's: parallel_devices[local_rank] is its device

    @property
    def world_size(self) -> int:
        return self.devices * self.num_nodes

    @property
    def device(self) -> torch.device:
        """This rank's device (Lightning's ``strategy.root_device``), known before Lightning starts."""
        return torch.device(self.parallel_devices[self.local_rank] if self.parallel_devices else "cpu")


def _slurm_int(value: str) -> int:
    return int(re.match(r"\d+", value).group())  # "2(x2)" -> 2: Slurm's compressed per-node counts


def plan_launch(device: str, devices: int | None, num_nodes: int | None, gpus_visible: int | None = None,
                env: Mapping[str, str] | None = None) -> LaunchPlan:
    """Check ``--devices``/``--num-nodes`` against the launcher and place this rank, before Lightning starts.

    Lightning checks ``devices``/``num_nodes`` against Slurm's or torchrun's layout itself, when
    ``fit()`` starts its launcher (after the data and the model are built); this makes the same
    check first, with the fix in the same line. It adds what Lightning cannot see: a plain
    ``python`` in a multi-task batch script leaves Lightning waiting for ranks that never start,
    and Lightning puts local rank r on GPU r, which under Slurm's GPU binding (``--gpus-per-task``,
    ``--gpu-bind``) is a GPU the task cannot see. Each mistake is one
    :class:`LaunchMismatch` here, and the device comes from the course's one policy
    (:func:`course_utils.devices.node_device`), handed to Lightning as the strategy's
    ``parallel_devices``. ``gpus_visible`` and ``env`` are this process's facts (read when not given).
    """
    env = os.environ if env is None else env
    if gpus_visible is None:
        gpus_visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpus = gpus_visible
    local_rank = 0
    # Lightning reads Slurm's variables itself (its SLURMEnvironment: whenever SLURM_NTASKS is set outside an
    # interactive job and torchrun did not start the process, even behind slurm/lib/torch_env.sh), so these checks
    # follow what Lightning will do, not the course's translation (torch_env.sh, process_group.detect_env).
    # Lightning asks torchrun first (TORCHELASTIC_RUN_ID): torchrun inside a Slurm job (a notebook's run_script in a
    # JupyterLab job, idev) is torchrun's layout, not the job's tasks.
    torchrun = "TORCHELASTIC_RUN_ID" in env
    if not torchrun and "SLURM_NTASKS" in env and env.get("SLURM_JOB_NAME") not in ("bash", "interactive"):
        launcher = "slurm"
        if _slurm_int(env["SLURM_NTASKS"]) > 1 and "SLURM_STEP_NUM_TASKS" not in env:
            raise LaunchMismatch("this job has several tasks but the script was not started by srun, so Lightning "
                                 "would wait for ranks that never start: run it as `srun python scripts/...`")
        if "SLURM_NTASKS_PER_NODE" not in env and _slurm_int(env["SLURM_NTASKS"]) > 1:
            raise LaunchMismatch("Lightning needs the tasks per node: request --ntasks-per-node=N (with --nodes), "
                                 "not --ntasks")
        per_node, nodes = _slurm_int(env.get("SLURM_NTASKS_PER_NODE", "1")), _slurm_int(env.get("SLURM_NNODES", "1"))
        local_rank = int(env.get("SLURM_LOCALID", "0") or 0)
        where = f"the job runs --ntasks-per-node={per_node} on --nodes={nodes}"
    elif "LOCAL_WORLD_SIZE" in env and "WORLD_SIZE" in env:
        launcher = "torchrun"
        per_node = int(env["LOCAL_WORLD_SIZE"])
        nodes = max(1, int(env["WORLD_SIZE"]) // per_node)
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
        where = f"torchrun started {per_node} process(es) per node on {nodes} node(s)"
    else:  # Lightning starts the ranks: LOCAL_RANK is unset in the first, set in those it starts
        launcher, per_node, nodes, where = "none", devices or 1, num_nodes or 1, ""
        local_rank = int(env.get("LOCAL_RANK", "0") or 0)
    if devices is not None and devices != per_node:
        raise LaunchMismatch(f"--devices {devices} but {where}: pass --devices {per_node}, or leave it out "
                             "(the script reads it from the launcher)")
    if num_nodes is not None and num_nodes != nodes:
        raise LaunchMismatch(f"--num-nodes {num_nodes} but {where}: pass --num-nodes {nodes}, or leave it out")

    bound = launcher == "slurm" and gpus_bound(env)
    try:
        mine = node_device(device, per_node, gpus, local_rank, bound)
    except (PlacementError, ValueError) as exc:
        raise LaunchMismatch(str(exc)) from exc
    if mine == "cpu":
        note = "" if gpus == 0 or device == "cpu" else (
            f"{per_node} ranks per node but only {gpus} GPU(s): every rank runs on the CPU with gloo "
            "(NCCL never puts two ranks on one GPU)")
        return LaunchPlan("cpu", per_node, nodes, launcher, note, ("cpu",) * per_node, local_rank)
    if launcher == "none" or mine == f"cuda:{local_rank}" and not bound:
        # every rank sees the node's GPUs: rank r takes GPU r (and Lightning's DeepSpeed checks exactly that)
        placed = tuple(f"cuda:{r}" for r in range(per_node))
    else:  # bound: each task's own GPU is its cuda:0; only this rank's entry is read (root_device)
        placed = (mine,) * per_node
    return LaunchPlan("gpu", per_node, nodes, launcher, "", placed, local_rank)


def placement_args(plan: LaunchPlan, ddp_strategy: type, **strategy_kwargs: Any) -> dict[str, Any]:
    """``accelerator``, ``devices``, ``num_nodes`` and ``strategy`` for a Lightning ``Trainer`` or a ``Fabric``
    (``ddp_strategy``: the ``DDPStrategy`` class of either). Several ranks get their devices from the plan as
    the strategy's ``parallel_devices`` (a device count would be checked against the visible GPUs, and
    Lightning would put rank r on GPU r); one process gets its GPU's index, or one CPU."""
    if plan.world_size > 1:
        strategy = ddp_strategy(parallel_devices=[torch.device(d) for d in plan.parallel_devices], **strategy_kwargs)
        return {"accelerator": plan.accelerator, "devices": "auto", "num_nodes": plan.num_nodes, "strategy": strategy}
    devices = [plan.device.index] if plan.device.type == "cuda" else 1
    return {"accelerator": plan.accelerator, "devices": devices, "num_nodes": plan.num_nodes, "strategy": "auto"}


def add_launch_args(parser: argparse.ArgumentParser) -> None:
    """``--devices`` and ``--num-nodes`` for the Lightning and Fabric scripts (checked by :func:`plan_launch`)."""
    parser.add_argument("--devices", type=int, help="ranks per node (default: what the launcher started)")
    parser.add_argument("--num-nodes", type=int, help="nodes (default: what the launcher started)")


def strategy_refused(strategy: str, plan: LaunchPlan) -> str | None:
    """Why ``strategy`` cannot run with ``plan`` (one line that says what to do instead), or None.

    Lightning 2.6 runs ``fsdp`` (FSDP1) and ``deepspeed_stage_2`` on CUDA GPUs only: the Trainer refuses
    ``fsdp`` with another accelerator, and ``DeepSpeedStrategy.setup_environment`` refuses it once ``fit``
    starts, after the data and model are built. ``fsdp2`` (``ModelParallelStrategy``) runs on CPUs with gloo
    too, as the course's own sharded scripts do (notebook 07)."""
    if strategy not in STRATEGIES:
        return f"--strategy {strategy}: choose one of {', '.join(STRATEGIES)}"
    if strategy in ("fsdp", "deepspeed_stage_2") and plan.accelerator != "gpu":
        instead = "--strategy fsdp2 (FSDP2)" if strategy == "fsdp" else "scripts/train_deepspeed.py"
        return (f"--strategy {strategy}: Lightning runs it on CUDA GPUs only, and this run is on {plan.device}; "
                f"{instead} shards the same model on CPUs too (notebook 07)")
    indices = [torch.device(d).index for d in plan.parallel_devices]
    if strategy.startswith("deepspeed") and indices != list(range(len(indices))):
        # DeepSpeedStrategy.setup_distributed refuses it in fit(), after the data and the model are built
        return (f"--strategy {strategy}: Lightning's DeepSpeed wants local rank r on GPU r of the GPUs every rank "
                f"sees, and this node's ranks are on {', '.join(plan.parallel_devices)} (Slurm binds a GPU to each "
                "task, or --device names one): submit without GPU binding (no --gpus-per-task, no COURSE_GPU_BIND), "
                "or use --strategy ddp or fsdp")
    return None


def precision_refused(strategy: str, precision: str) -> str | None:
    """Why ``strategy`` cannot train in the resolved ``precision`` (one line), or None. Lightning 2.6's
    ``ModelParallelStrategy`` (``fsdp2``) takes fp32 and bf16 but no fp16 AMP, which needs a gradient scaler
    (``amp`` resolves to fp16 on GPUs without bf16: Frontera's RTX 5000)."""
    if strategy == "fsdp2" and precision == "fp16":
        return ("--strategy fsdp2 trains in fp32 or bf16 (Lightning's ModelParallelStrategy has no fp16 AMP) and "
                "this run resolved to fp16: use --precision fp32 on a GPU without bf16, or --strategy ddp or "
                "deepspeed_stage_2, whose fp16 has loss scaling")
    return None


def precision_args(strategy: str, precision: str) -> tuple[str, dict[str, Any]]:
    """Lightning's ``precision=`` and what ``strategy`` is given for it, from the course's resolved ``precision``
    (fp32, bf16 or fp16: :func:`course_utils.precision.resolve_precision` decides it from the hardware).

    FSDP keeps the weights and the buffers (BatchNorm's running statistics) in fp32 whatever the precision;
    autocast, from Lightning's precision plugin, does the bf16/fp16 math, as under DDP. Left to Lightning 2.6,
    "16-mixed" and "bf16-mixed" cast the parameters *and the buffers* to fp16/bf16
    (``FSDPPrecision.mixed_precision_config``), and ``summon_full_params`` restores only the parameters to
    fp32: the evaluation after ``fit`` met batch norm with fp16 statistics and fp32 weights, a type error.
    Buffers alone in fp32 will not do: batch norm takes its weights and statistics in one dtype. The price:
    FSDP gathers and reduces fp32 (twice fp16's bytes), as DDP all-reduces fp32 gradients under autocast.
    """
    if precision not in LIGHTNING_PRECISION:
        raise ValueError(f"precision {precision!r}: resolve it first (one of {', '.join(LIGHTNING_PRECISION)})")
    if strategy != "fsdp":
        return LIGHTNING_PRECISION[precision], {}
    from torch.distributed.fsdp import MixedPrecision

    fp32 = torch.float32
    return LIGHTNING_PRECISION[precision], {
        "mixed_precision": MixedPrecision(param_dtype=fp32, reduce_dtype=fp32, buffer_dtype=fp32)}


def sharded_placement(strategy: str, plan: LaunchPlan, timeout: timedelta, **strategy_kwargs: Any) -> dict[str, Any]:
    """``placement_args`` for FSDP1, FSDP2 or DeepSpeed ZeRO-2: the strategy gets the plan's devices, also for one
    process (and ``strategy_kwargs``: :func:`precision_args`'s)."""
    devices = [torch.device(d) for d in plan.parallel_devices] or [plan.device]
    if strategy == "fsdp":  # FULL_SHARD: ZeRO-3's layout
        made = FSDPStrategy(parallel_devices=devices, timeout=timeout, **strategy_kwargs)
    elif strategy == "fsdp2":  # every rank one data-parallel shard: a mesh of one dimension, no tensor parallelism
        made = ModelParallelStrategy(data_parallel_size=plan.num_nodes * len(devices), tensor_parallel_size=1,
                                     timeout=timeout, **strategy_kwargs)
        made.parallel_devices = devices  # (it takes no devices argument; the Trainer reads them from here)
    else:
        made = DeepSpeedStrategy(stage=2, parallel_devices=devices, timeout=timeout, **strategy_kwargs)
    return {"accelerator": plan.accelerator, "devices": "auto", "num_nodes": plan.num_nodes, "strategy": made}
