"""What train_deepspeed.py and train_fsdp.py share: their flags, joining the group, the precision, DeepSpeed's
environment and ``ds_config``, and DeepSpeed's C++ op built once per environment."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from ..config import TrainConfig, unsupported
from ..devices import PlacementError
from ..process_group import DistEnv, RendezvousError, free_port, init_distributed
from ..models import CHECKPOINTABLE
from ..precision import resolve_precision


# --------------------------------------------------------------------------- #
# What train_deepspeed.py and train_fsdp.py share
# --------------------------------------------------------------------------- #
def add_sharding_args(parser: argparse.ArgumentParser, title: str) -> argparse._ArgumentGroup:
    """A flag group ``title`` with the options both sharded scripts take; the caller adds its own."""
    group = parser.add_argument_group(title)
    group.add_argument("--activation-checkpointing", action="store_true",
                       help="recompute activations in the backward pass (--model mlp)")
    group.add_argument("--gradient-clipping", type=float, default=1.0, help="max gradient norm (default: 1.0)")
    return group


def start_rank(cfg: TrainConfig, script: str, left_out: set[str],
               activation_checkpointing: bool = False) -> tuple[DistEnv, torch.device, str]:
    """Join the run's process group through the course's door (``dist.init_distributed``: one GPU per
    rank, ``set_device`` and ``device_id`` before the group exists, GPU binding understood) and return
    who this rank is, its device and its precision. One line and exit 1 when ``cfg`` asks for what
    ``script`` leaves out, for a layout the node cannot hold, or for activation checkpointing of a
    model not written for it. With one process the group is a group of one."""
    try:
        unsupported(cfg, script, left_out)
        if activation_checkpointing and cfg.model not in CHECKPOINTABLE:
            raise ValueError(f"--activation-checkpointing is written for --model {' or '.join(CHECKPOINTABLE)}")
        info, device = init_distributed(cfg.device, group_of_one=True)  # ZeRO and FSDP2 need a group, even of one
        return info, device, resolve_precision(cfg.precision, device)
    except (ValueError, PlacementError, RendezvousError) as exc:
        sys.exit(f"error: {exc}")


def shard_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """What FSDP2 shards one by one before the whole model: each child that holds parameters, and each block of a
    child ``ModuleList`` (a transformer's layers), so that a rank gathers one unit's weights at a time."""
    return [m for child in model.children() for m in (child if isinstance(child, torch.nn.ModuleList) else [child])
            if any(True for _ in m.parameters())]


def fsdp_precision(requested: str, resolved: str, script: str = "train_fsdp.py") -> tuple[str, str]:
    """The precision train_fsdp.py runs in, and a one-line note when it is not what was asked.

    FSDP2 here computes in bf16 or fp32. fp16 would need a gradient scaler over sharded
    gradients; on a GPU without bf16 (Frontera's RTX 5000) ``amp`` resolves to fp16, and the run
    falls back to fp32 and says so; ``--precision fp16`` asked for by name is refused.
    """
    if resolved != "fp16":
        return resolved, ""
    if requested == "amp":
        return "fp32", (f"note: this GPU has no bf16 and {script} does not train in fp16 (that needs a sharded "
                        "gradient scaler): running in fp32")
    raise ValueError(f"{script} trains in fp32 or bf16 (fp16 would need a sharded gradient scaler): use "
                     "--precision bf16 on Ampere or newer, fp32 (or amp) on older GPUs, or train_deepspeed.py, "
                     "whose fp16 has loss scaling")


# --------------------------------------------------------------------------- #
# DeepSpeed
# --------------------------------------------------------------------------- #
def deepspeed_env(use_gpu: bool, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables to set before ``import deepspeed`` (returned, not set): the accelerator
    (DeepSpeed picks it when imported), where its C++ ops are built (once per Python environment,
    ``sys.prefix/torch_extensions``, not in a home folder shared by every environment and torch
    version), and outside a launcher those of a one-process group. Only what ``environ`` lacks,
    and ``PATH`` with this environment's ``bin`` first where it is not.

    ``PATH``: torch builds the ops with the first ``ninja`` on it, and the environment's own (pip's,
    DeepSpeed's dependency) and a system one (Debian's ninja-build) hash their command lines
    differently: each rebuilt what the other had built, 40-140 s a time on this course's CI machine,
    every time a Slurm job (an activated environment) and a plain ``python`` took turns.

    A script sets them in its own process (``os.environ.update``); a notebook kernel sets them only
    around its import (``launch.temporary_env``), so that no later script inherits them.
    """
    environ = os.environ if environ is None else environ
    wanted = {"TORCH_EXTENSIONS_DIR": str(Path(sys.prefix) / "torch_extensions")}
    if not use_gpu:
        wanted["DS_ACCELERATOR"] = "cpu"
    if "WORLD_SIZE" not in environ:  # plain `python script.py`: a group of one (DeepSpeed would look for MPI)
        wanted.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(free_port()))
    missing = {k: v for k, v in wanted.items() if k not in environ}
    env_bin, path = str(Path(sys.executable).parent), environ.get("PATH", "")
    if path.split(os.pathsep)[0] != env_bin:
        missing["PATH"] = os.pathsep.join([env_bin, *(p for p in path.split(os.pathsep) if p and p != env_bin)])
    return missing


def deepspeed_device_env(device: torch.device, environ: Mapping[str, str]) -> dict[str, str]:
    """``LOCAL_RANK`` as DeepSpeed must read it (returned, not set): ``deepspeed.initialize`` (and ZeRO-3's
    ``Init``) calls ``set_device(int(LOCAL_RANK))`` itself, after the course placed this rank on ``device``.
    Where Slurm binds a GPU to each task, that is every task's ``cuda:0`` while ``LOCAL_RANK`` is the task's
    place on its node: DeepSpeed would ask for a GPU the task cannot see ("invalid device ordinal")."""
    if device.type != "cuda" or device.index is None or environ.get("LOCAL_RANK") == str(device.index):
        return {}
    return {"LOCAL_RANK": str(device.index)}


def ds_config(cfg: TrainConfig, world: int, stage: int, precision: str, offload: bool = False,
              clip: float = 1.0, bucket_elements: int = 2_000_000, use_gpu: bool = False) -> dict[str, Any]:
    """The DeepSpeed configuration of a course run (notebook 07 explains it field by field)."""
    zero: dict[str, Any] = {
        "stage": stage,
        # buckets of gradients reduced (and of weights gathered) at once, in elements: DeepSpeed's
        # default 5e8 would allocate a 1 GB bf16 buffer for a 4 M-parameter model
        "reduce_bucket_size": bucket_elements,
        "allgather_bucket_size": bucket_elements,
    }
    if stage == 3:
        zero.update({
            # every weight is sharded, however small (the default keeps those under 1e5 whole)
            "stage3_param_persistence_threshold": 0,
            # and gathered just before its layer runs, then freed, in the forward and again in the backward
            # pass, as the paper's stage 3. DeepSpeed's defaults keep a gathered weight whole while it is used
            # again within 1e9 elements (max_reuse_distance, zero/partitioned_param_coordinator.py:653-662) or
            # its prefetcher reached its next use while it was still whole (5e7 elements, lines 452-471,
            # 646-651): for this 4 M-parameter model, every weight from its forward to its backward pass
            "stage3_max_reuse_distance": 0,
            "stage3_prefetch_bucket_size": 0,
        })
    if offload:
        # the fp32 master weights, the moments and the optimizer step move to the CPU's memory
        # page-locked on a GPU node: the copies to and from the GPU then run at full PCIe speed
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": use_gpu}
    return {
        # the global batch: per-rank batch x accumulation x ranks (DeepSpeed checks the product)
        "train_batch_size": cfg.batch_size * cfg.grad_accum * world,
        "train_micro_batch_size_per_gpu": cfg.batch_size,
        "gradient_accumulation_steps": cfg.grad_accum,
        # bf16: weights and gradients in bf16, an fp32 master copy in the optimizer; fp16 adds loss scaling
        "bf16": {"enabled": precision == "bf16"},
        # fp16 only: its loss scale starts at 2**12 (DeepSpeed's default is 2**16)
        "fp16": {"enabled": True, "initial_scale_power": 12} if precision == "fp16" else {"enabled": False},
        "gradient_clipping": clip,
        "zero_optimization": zero,
        # the course's own optimizer (make_optimizer) runs on the offloaded state, where DeepSpeed
        # would otherwise insist on its CPU Adam (a C++ op built on first use)
        "zero_force_ds_cpu_optimizer": False,
        # ZeRO was tested by DeepSpeed with Adam-like optimizers; the course's SGD works too, when allowed
        "zero_allow_untested_optimizer": True,
        # counts every collective DeepSpeed calls (read back by stop_counting_collectives). It also waits
        # for each collective to finish, so the script counts only during the untimed first steps
        # and then switches it off: images/s is measured without it.
        "comms_logger": {"enabled": True, "verbose": False, "prof_all": True, "debug": False},
        "steps_per_print": 10**9,  # the course prints its own progress
    }




def warm_deepspeed_ops() -> None:
    """Build the C++ ops DeepSpeed compiles on first use on this machine, once per environment
    (``make setup`` runs this, so that no notebook or test pays the build, and no two ranks race for it).
    That is the CPU accelerator's shared-memory collectives, on a GPU node too: notebook 07 runs its ranks on the
    CPU wherever a node has fewer GPUs than ranks (a 1-GPU portal, one H100), and the CUDA accelerator has no such op.
    """
    os.environ.update(deepspeed_env(use_gpu=False))  # (make setup's own process)
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    if builder is not None and deepspeed.ops.__compatible_ops__.get(builder.NAME, False):
        builder.load(verbose=False)
        print(f"DeepSpeed's {builder.NAME} op is built in {os.environ['TORCH_EXTENSIONS_DIR']}")
