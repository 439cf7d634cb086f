"""TrainConfig: every knob of a training run, in one place.

Each field carries its help text, its group and its limits, and everything
else is generated from them: a script's command line (:func:`add_config_args`),
the flags that reproduce a configuration (:func:`config_flags`, how notebook
01 hands its best rung to ``scripts/train.py``), a TOML config file with
command-line overrides on top (:func:`config_from_args`, as NERSC's tutorial
does with YAML), and the check that a checkpoint is resumed by the same run
(:func:`resume_mismatch`)::

    python scripts/train.py --config configs/ft3_resnet.toml --epochs 5

A config file sets any field, flat or under the help groups' tables::

    model = "resnet18"
    [speed]
    precision = "amp"
    channels_last = true
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tomllib
import types
from dataclasses import dataclass, field, fields
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Union, get_args, get_origin, get_type_hints

from .data import DATASETS
from .devices import DEVICE_HELP
from .models import MODELS
from .precision import PRECISIONS

GROUPS = ("data", "training", "speed", "output", "transformer")
IMAGE_GROUPS = GROUPS[:4]  # the image scripts' flags; scripts/train_lm.py adds the transformer's
OPTIMIZERS = ("sgd", "adamw")


def knob(default: Any, group: str, help: str, *, choices: tuple[str, ...] | None = None, minimum: float | None = None,
         positive: bool = False, same_on_resume: bool = False, flag: bool = True) -> Any:
    """A :class:`TrainConfig` field with what its command line and resume check need.

    ``minimum``: the smallest value accepted; ``positive``: above zero. ``same_on_resume``: a
    checkpoint written with another value cannot be resumed (the model, the
    batch per rank, the precision). ``flag=False``: settable from Python and
    config files only.
    """
    assert group in GROUPS, group
    meta = {"group": group, "help": help, "choices": choices, "minimum": minimum, "positive": positive,
            "same_on_resume": same_on_resume, "flag": flag}
    return field(default=default, metadata=meta)


@dataclass
class TrainConfig:
    # data
    dataset: str = knob("synthetic", "data", "synthetic needs no download; cifar10/mnist: see "
                        "python -m course_utils.data", choices=DATASETS, same_on_resume=True)
    data_root: str | None = knob(None, "data", "folder with the data (default $COURSE_DATA or data/)")
    n_train: int | None = knob(None, "data", "use only this many training images", minimum=1, same_on_resume=True)
    n_val: int | None = knob(None, "data", "use only this many validation images", minimum=1)
    workers: int = knob(2, "data", "DataLoader worker processes per rank", minimum=0)
    pin_memory: bool = knob(False, "data", "page-locked host memory (GPU only)")
    seed: int = knob(0, "data", "seed of the weights, the data order and the synthetic images", same_on_resume=True)
    # model and optimisation
    model: str = knob("cnn", "training", "the network", choices=MODELS, same_on_resume=True)
    epochs: int = knob(2, "training", "train until this many epochs are done", minimum=1)
    batch_size: int = knob(128, "training", "per rank; global = this x world size x grad-accum",
                           minimum=1, same_on_resume=True)
    lr: float = knob(0.05, "training", "learning rate (per rank-batch with --scale-lr)", positive=True)
    optimizer: str = knob("sgd", "training", "sgd (with --momentum) or adamw (Adam's two moments per parameter: "
                          "the optimizer state notebook 07 shards; try --lr 1e-3)", choices=OPTIMIZERS,
                          same_on_resume=True)
    momentum: float = knob(0.9, "training", "SGD momentum", minimum=0, same_on_resume=True)
    weight_decay: float = knob(5e-4, "training", "weight decay (SGD: an L2 term in the gradient; AdamW: decoupled)",
                               minimum=0)
    grad_accum: int = knob(1, "training", "micro-batches per optimiser step", minimum=1,
                           same_on_resume=True)
    scale_lr: bool = knob(False, "training", "linear scaling rule: lr x world size x grad-accum",
                          same_on_resume=True)
    warmup_epochs: float = knob(0.0, "training", "linear learning-rate warm-up (Goyal et al. 2017)",
                                minimum=0)
    steps_per_epoch: int | None = knob(None, "training", "cap batches per epoch (quick runs)",
                                       minimum=1)
    # speed
    device: str = knob("auto", "speed", DEVICE_HELP)
    precision: str = knob("fp32", "speed", "fp32, bf16, fp16, or amp (a GPU: bf16 from Ampere on, fp16 before; "
                          "a CPU: bf16 where it has bf16 instructions, fp32 where bf16 would be emulated)",
                          choices=PRECISIONS, same_on_resume=True)
    tf32: bool | None = knob(None, "speed", "TF32 tensor cores for fp32 matmuls and convolutions (Ampere+); "
                             "unset: PyTorch's defaults (convolutions only)")
    cudnn_benchmark: bool = knob(False, "speed", "let cuDNN time its algorithms for fixed input shapes")
    channels_last: bool = knob(False, "speed", "NHWC memory format for convolutions")
    compile: bool = knob(False, "speed", "torch.compile the model")
    bucket_cap_mb: float = knob(25.0, "speed", "DDP: gradients are all-reduced in buckets of this size",
                          positive=True)
    grad_as_bucket_view: bool = knob(False, "speed", "DDP: gradients live in the buckets (no copy)")
    # output
    ckpt_dir: str | None = knob(None, "output", "write last.pt here each epoch, and resume from it")
    ckpt_every_steps: int | None = knob(None, "output", "also write last.pt every N optimiser steps (a killed job "
                                        "then loses at most N steps)", minimum=1)
    resume: bool = knob(True, "output", "continue from the checkpoint in --ckpt-dir when there is one")
    log_dir: str | None = knob(None, "output", "TensorBoard event files (rank 0)")
    trace_dir: str | None = knob(None, "output", "record 3 steps with torch.profiler after the untimed ones: a "
                                 "Chrome trace per rank here (rank<r>.json: Perfetto, HTA; course_utils.traces)")
    progress: bool = knob(True, "output", "a progress bar per epoch (on a terminal; batch logs never get one)")
    log_every: int = knob(10, "output", "log the loss every N steps", minimum=1)
    untimed_steps: int = knob(2, "output", "first steps of an epoch left out of images/s (cuDNN autotuning, "
                              "compile, worker start-up)", minimum=0)
    # the transformer (scripts/train_lm.py): its text, its size, and how its ranks split it
    text: str = knob("stdlib", "transformer", "a text file to train on, as bytes; stdlib: this Python's own "
                     "sources, on every machine", same_on_resume=True)
    lm_size: str = knob("tiny", "transformer", "the decoder's size (course_utils.llama.LM_SIZES)",
                        choices=("tiny", "small", "base"), same_on_resume=True)
    tied: bool = knob(False, "transformer", "one weight for the embedding and the head (GPT-2's; not with --tp "
                      "or --pp)", same_on_resume=True)
    seq_len: int = knob(64, "transformer", "tokens per sequence", minimum=2, same_on_resume=True)
    steps: int = knob(20, "transformer", "train until this many optimiser steps are done", minimum=1)
    dp_shard: int = knob(1, "transformer", "ranks that shard the weights (FSDP2)", minimum=1)
    dp_replicate: int = knob(1, "transformer", "replicas of the sharded model (HSDP: with --dp-shard, "
                             "shard within a node, replicate across)", minimum=1)
    cp: int = knob(1, "transformer", "context-parallel ranks: each holds a share of every sequence, attention "
                   "round a ring (zig-zag split)", minimum=1)
    cp_layout: str = knob("zigzag", "transformer", "how --cp splits a sequence: 2N chunks, rank r holding r and "
                          "2N-1-r (zigzag, even work under the causal mask), or N in order (contiguous)",
                          choices=("zigzag", "contiguous"))
    tp: int = knob(1, "transformer", "tensor-parallel ranks (heads and hidden units split; a node's GPUs)",
                   minimum=1)
    experts: int = knob(0, "transformer", "make every MLP a mixture of this many experts, 2 per token (0: dense)",
                        minimum=0, same_on_resume=True)
    ep: int = knob(1, "transformer", "expert-parallel ranks: the experts spread over the --dp-shard ranks, tokens "
                   "sent to their experts with all-to-all", minimum=1)
    aux_loss: float = knob(0.01, "transformer", "the experts' load-balancing loss, times this, added to the training "
                           "loss (Switch Transformer's; 0: none)", minimum=0)
    pp: int = knob(1, "transformer", "pipeline stages (consecutive blocks each; the embedding on the first, the "
                   "head on the last)", minimum=1)
    microbatches: int = knob(4, "transformer", "micro-batches a rank's batch is cut into for the pipeline (--pp)",
                             minimum=1)
    pp_schedule: str = knob("1f1b", "transformer", "the pipeline's schedule: all forwards then all backwards "
                            "(gpipe), or alternating once full (1f1b)", choices=("gpipe", "1f1b"))
    float8: bool = knob(False, "transformer", "train the Linear layers in float8 (torchao; GPUs of compute "
                        "capability 8.9+)")
    ac: str = knob("none", "transformer", "activation checkpointing per block: recompute all of it, or only "
                   "the cheap ops", choices=("none", "selective", "full"))


# --------------------------------------------------------------------------- #
# Field types, values and flags
# --------------------------------------------------------------------------- #
def _base_type(f: dataclasses.Field) -> type:
    """``int | None`` -> ``int``."""
    hint = get_type_hints(TrainConfig)[f.name]
    if get_origin(hint) in (Union, types.UnionType):
        hint = next(a for a in get_args(hint) if a is not type(None))
    return hint


def _convert(f: dataclasses.Field, value: Any) -> Any:
    """``value`` (from a flag's text or a config file) as the field's type, within its limits."""
    kind, meta = _base_type(f), f.metadata
    if kind is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{f.name} takes true or false, not {value!r}")
        return value
    if kind in (int, float) and isinstance(value, bool) or kind is int and isinstance(value, float):
        raise ValueError(f"{f.name} takes a whole number, not {value!r}")
    try:
        value = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{f.name} takes a{'n' if kind is int else ''} {kind.__name__}, not {value!r}") from None
    if meta["minimum"] is not None and value < meta["minimum"]:
        raise ValueError(f"{f.name} must be >= {meta['minimum']}, got {value}")
    if meta["positive"] and not value > 0:
        raise ValueError(f"{f.name} must be > 0, got {value}")
    if meta["choices"] and value not in meta["choices"]:
        raise ValueError(f"{f.name} must be one of: {', '.join(meta['choices'])} (got {value!r})")
    return value


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def add_config_args(parser: argparse.ArgumentParser, groups: tuple[str, ...] = IMAGE_GROUPS) -> None:
    """Every :class:`TrainConfig` field of ``groups`` as a flag, in its help group, plus ``--config FILE``.

    The flags' defaults are left unset so that :func:`config_from_args` can
    tell a flag given on the command line (it wins) from a config file's value.
    """
    sections = {g: parser.add_argument_group(g) for g in groups}
    sections["output"].add_argument("--config", type=Path, default=None,
                                  help="a TOML file of these settings; flags given here override it")
    defaults = TrainConfig()
    for f in fields(TrainConfig):
        if not f.metadata.get("flag") or f.metadata["group"] not in groups:
            continue
        default = getattr(defaults, f.name)
        help_ = f.metadata["help"] + ("" if default is None else f" (default: {default})")
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS, "help": help_}
        if _base_type(f) is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.metadata["choices"]:
            kwargs["choices"] = f.metadata["choices"]  # argparse lists them in its error
        else:
            kwargs["type"] = _arg_type(f)
            kwargs["metavar"] = f.name.upper()
        sections[f.metadata["group"]].add_argument(_flag(f.name), **kwargs)


def _arg_type(f: dataclasses.Field) -> Any:
    def convert(text: str) -> Any:
        try:
            return _convert(f, text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc).removeprefix(f"{f.name} ")) from None

    convert.__name__ = _base_type(f).__name__  # argparse names the type in its messages
    return convert


def load_config_file(path: str | Path) -> dict[str, Any]:
    """The settings of a TOML file, checked against :class:`TrainConfig`'s fields."""
    path = Path(path)
    try:
        raw = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"cannot read the config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the config file {path} is not valid TOML: {exc}") from exc
    flat: dict[str, Any] = {}
    for key, value in raw.items():
        if isinstance(value, dict) and key in GROUPS:
            flat.update(value)
        else:
            flat[key] = value
    by_name = {f.name: f for f in fields(TrainConfig)}
    settings = {}
    for key, value in flat.items():
        name = key.replace("-", "_")
        if name not in by_name:
            raise ValueError(f"{path}: unknown setting {key!r}; the settings are: {', '.join(by_name)}")
        try:
            settings[name] = _convert(by_name[name], value)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None
    return settings


def config_from_args(args: argparse.Namespace, defaults: Mapping[str, Any] | None = None) -> TrainConfig:
    """Defaults (``defaults``: a script's own, over :class:`TrainConfig`'s), then the ``--config`` file, then
    the flags given: the run's :class:`TrainConfig`."""
    settings = dict(defaults or {})
    settings.update(load_config_file(args.config) if getattr(args, "config", None) else {})
    names = {f.name for f in fields(TrainConfig)}
    settings.update({k: v for k, v in vars(args).items() if k in names})
    return TrainConfig(**settings)


def job_run_dir(environ: Mapping[str, str] | None = None) -> Path | None:
    """The folder of the course Slurm job this process runs in: ``RUN_DIR``, made and exported by
    ``slurm/lib/course_job.sh`` (a folder per job, per trial of a sweep, or COURSE_RUN_NAME's); None outside one.
    The batch scripts name no Python script: each of the course's scripts asks here where its outputs go."""
    environ = os.environ if environ is None else environ
    return Path(environ["RUN_DIR"]) if environ.get("RUN_DIR") and environ.get("SLURM_JOB_ID") else None


def in_run_dir(config: TrainConfig, logs: bool = True, environ: Mapping[str, str] | None = None) -> TrainConfig:
    """``config`` with its outputs in the job's folder (:func:`job_run_dir`) where its settings name none:
    checkpoints in ``RUN_DIR/ckpt``, TensorBoard logs in ``RUN_DIR/tb`` (``logs``: the script writes them).
    A ``--ckpt-dir`` or ``--log-dir`` of your own wins; outside a course job nothing changes."""
    run_dir = job_run_dir(environ)
    if run_dir is None:
        return config
    outputs = {"ckpt_dir": config.ckpt_dir or str(run_dir / "ckpt")}
    if logs:
        outputs["log_dir"] = config.log_dir or str(run_dir / "tb")
    return dataclasses.replace(config, **outputs)


def config_flags(config: TrainConfig, base: TrainConfig | None = None) -> list[str]:
    """The flags that turn ``base`` (default: the defaults) into ``config``, for ``scripts/train.py``."""
    base = base or TrainConfig()
    flags: list[str] = []
    for f in fields(TrainConfig):
        value = getattr(config, f.name)
        if value == getattr(base, f.name) or not f.metadata.get("flag"):
            continue
        if isinstance(value, bool):
            flags.append(_flag(f.name) if value else "--no-" + f.name.replace("_", "-"))
        elif value is None:
            raise ValueError(f"{f.name}=None differs from the base and has no flag; use a config file")
        else:
            flags += [_flag(f.name), str(value)]
    return flags


def changes(config: TrainConfig, base: TrainConfig | None = None) -> dict[str, Any]:
    """The fields of ``config`` that differ from ``base`` (default: the defaults)."""
    base = base or TrainConfig()
    return {f.name: getattr(config, f.name) for f in fields(TrainConfig)
            if getattr(config, f.name) != getattr(base, f.name)}


def resume_mismatch(saved: dict[str, Any], current: TrainConfig) -> list[str]:
    """``field: saved -> now`` for each setting a resumed run must keep (empty: it may resume).

    ``saved`` is the config a checkpoint recorded; fields it lacks (written by
    an older version) are not compared.
    """
    return [f"{f.name} {saved[f.name]!r} -> {getattr(current, f.name)!r}" for f in fields(TrainConfig)
            if f.metadata.get("same_on_resume") and f.name in saved and saved[f.name] != getattr(current, f.name)]


def unsupported(config: TrainConfig, script: str, ignored: set[str]) -> None:
    """Raise ValueError naming the settings ``script`` does not implement that ``config`` changes.

    A script that leaves a knob out says so rather than training without it.
    """
    asked = sorted(set(changes(config)) & ignored)
    if asked:
        flags = ", ".join(_flag(name) for name in asked)
        raise ValueError(f"{script} does not implement {flags}: leave it out, or use scripts/train.py")
