"""The full profile (COURSE_PROFILE=full), computed for each workshop target, without a GPU (issue 31).

CI runs the ``ci`` profile; a workshop runs ``full`` on GPUs. Here every ``pick(...)`` of notebooks
00-10 is read from the notebook itself (``ast``), evaluated with the real ``course_utils.sizing.pick``
as it would be on each target of ``course_utils.targets`` (COURSE_PROFILE=full, that many GPUs
visible), and the layouts that follow are checked: divisions exact, ranks never more than GPUs,
memory within the card, precision from the compute capability, timeouts and Slurm time limits above
an estimated run time. ``test_every_full_profile_value_is_checked`` fails on a ``pick`` no test here
claims. Nothing trains and nothing is launched.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import math
import re
import shlex
import tomllib
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from course_utils import sizing, slurm
from course_utils.config import TrainConfig, add_config_args, config_from_args
from course_utils.data.loaders import make_loader
from course_utils.data.shards import reader_spans
from course_utils.devices import plan_demo
from course_utils.models import build_model, count_parameters
from course_utils.paths import REPO_ROOT, SCRIPTS
from course_utils.precision import BF16_MIN_CAPABILITY, precision_for
from course_utils.setup import plan_ranks
from course_utils.sharding import bytes_per_param, fsdp_precision
from course_utils.targets import CLUSTERS, TARGETS
from course_utils.tuning import trials_per_node

NOTEBOOKS = REPO_ROOT / "notebooks"
GiB = 2**30

# --------------------------------------------------------------------------- #
# What the estimates assume (each errs towards a longer run or a fuller card)
# --------------------------------------------------------------------------- #
STEP_EFFICIENCY = 0.3  # share of the card's sustained matmul rate a training step reaches: the low end of 30-50%
LOADER_IMAGES_PER_S = 2000  # one DataLoader process, the course's 32x32 images with their per-sample work:
#                             4,000/s measured on the 2-core CI machine under a load of 8 (one process); halved
STARTUP_S = 60  # one launch: torch and the course imported from a cluster file system, the group formed
#                 (torchrun + 3 ranks of rpc_param_server.py: 17 s on the loaded CI machine)
COMPILE_S = 120  # torch.compile of ResNet-18, paid in the first steps
LINK_BYTES_PER_S = 10e9  # GPU-to-GPU without NVLink (PCIe 3 x16): errs slow for FT3's and the H100's links
FS_BYTES_PER_S = 200e6  # an fsync'd checkpoint on a shared file system (NFS home, a Lustre client under load)
GLOO_BYTES_PER_S = 0.5e9  # gloo over loopback, one rank's send rate in an all-reduce on CPUs
CUDA_CONTEXT_BYTES = 1 * GiB  # the CUDA context, cuDNN's workspace, the allocator's slack
MEMORY_MARGIN = 0.8  # what may be planned of a card: the rest for fragmentation and the driver
TIMEOUT_MARGIN = 1.5  # a timeout or time limit must exceed the estimate by this much


# --------------------------------------------------------------------------- #
# Reading the notebooks: every pick(...), labelled by where it sits
# --------------------------------------------------------------------------- #
@lru_cache
def notebook(number: str) -> Path:
    (path,) = NOTEBOOKS.glob(f"{number}_*.ipynb")
    return path


@lru_cache
def cells(number: str) -> tuple[ast.Module, ...]:
    out = []
    for cell in json.loads(notebook(number).read_text())["cells"]:
        if cell["cell_type"] == "code":
            lines = "".join(cell["source"]).splitlines()
            out.append(ast.parse("\n".join("" if line.lstrip().startswith(("%", "!")) else line for line in lines)))
    return tuple(out)


def _label(node: ast.AST, parents: dict[ast.AST, ast.AST]) -> str:
    """Where a pick sits, outermost first: ``run / run_script(train.py) / timeout_s=``, ``args / --epochs``."""
    parts, child, below = [], node, node
    while child in parents:
        parent = parents[child]
        if isinstance(parent, ast.keyword):
            parts.append(f"{parent.arg}=" if parent.arg else "**")
        elif isinstance(parent, ast.Dict) and child in parent.values:
            key = parent.keys[parent.values.index(child)]
            parts.append(f"{ast.literal_eval(key)}:" if key is not None else "**")
        elif isinstance(parent, (ast.List, ast.Tuple)):
            i = parent.elts.index(child)
            flag = parent.elts[i - 1] if i else None
            if isinstance(flag, ast.Constant) and isinstance(flag.value, str) and flag.value.startswith("-"):
                parts.append(flag.value)
        elif isinstance(parent, ast.Call) and child is not parent.func:
            first = next((a.value for a in parent.args if isinstance(a, ast.Constant) and isinstance(a.value, str)), "")
            parts.append(f"{ast.unparse(parent.func)}({first})")
        elif isinstance(parent, ast.Compare):
            parts.append(f"{ast.unparse(parent.left)} ==")
        elif isinstance(parent, ast.Assign):
            target = parent.targets[0]
            if isinstance(target, ast.Tuple) and isinstance(parent.value, ast.Tuple):
                target = target.elts[parent.value.elts.index(below)]
            parts.append(ast.unparse(target))
            break
        elif isinstance(parent, ast.stmt):
            parts.append(type(parent).__name__.lower())
            break
        below, child = child, parent
    return " / ".join(reversed(parts))


@lru_cache
def picks(number: str) -> dict[str, ast.Call]:
    """Every ``pick(...)`` call of the notebook, by label (a repeated label gets `` #2``, ...)."""
    found: dict[str, ast.Call] = {}
    for tree in cells(number):
        parents = {c: p for p in ast.walk(tree) for c in ast.iter_child_nodes(p)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and ast.unparse(node.func).split(".")[-1] == "pick":
                label, k = _label(node, parents), 1
                while (label if k == 1 else f"{label} #{k}") in found:
                    k += 1
                found[label if k == 1 else f"{label} #{k}"] = node
    return found


def assigned(number: str, name: str) -> ast.expr:
    """The expression first assigned to ``name`` in the notebook (an element of a tuple assignment too)."""
    for tree in cells(number):
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                target = node.targets[0]
                if isinstance(target, ast.Name) and target.id == name:
                    return node.value
                if isinstance(target, ast.Tuple) and name in [ast.unparse(e) for e in target.elts]:
                    i = [ast.unparse(e) for e in target.elts].index(name)
                    if isinstance(node.value, ast.Tuple):
                        return node.value.elts[i]
                    return ast.Subscript(node.value, ast.Constant(i), ast.Load())
    raise LookupError(f"notebook {number} assigns no {name}")


def call_keywords(number: str, call: str, keyword: str) -> list:
    """The constant ``keyword=`` of each call whose source starts with ``call`` (``run_script('train.py'``)."""
    return [k.value.value for tree in cells(number) for node in ast.walk(tree)
            if isinstance(node, ast.Call) and ast.unparse(node).startswith(call)
            for k in node.keywords if k.arg == keyword and isinstance(k.value, ast.Constant)]


def flag_constant(number: str, flag: str):
    """The constant after ``flag`` in a list of the notebook (the first such list)."""
    return next(n.elts[n.elts.index(f) + 1].value for tree in cells(number) for n in ast.walk(tree)
                if isinstance(n, ast.List) for f in n.elts if isinstance(f, ast.Constant) and f.value == flag)


@lru_cache
def synthetic_sizes() -> tuple[int, int]:
    """The synthetic set's training and validation images when train.py is given no --n-train/--n-val
    (``n_tr, n_va = n_train or 20_000, n_val or 4_000`` in course_utils/data/sources.py)."""
    tree = ast.parse((NOTEBOOKS / "course_utils" / "data" / "sources.py").read_text())
    (value,) = [n.value for n in ast.walk(tree) if isinstance(n, ast.Assign)
                and ast.unparse(n.targets[0]) == "(n_tr, n_va)" and "n_train or" in ast.unparse(n.value)]
    return tuple(v.values[1].value for v in value.elts)


CIFAR10_TRAIN, CIFAR10_TEST = 50_000, 10_000  # the data set's splits


class Full:
    """Notebook expressions evaluated as on ``target``'s node: COURSE_PROFILE=full, its GPUs visible."""

    def __init__(self, target, monkeypatch):
        self.target = target
        monkeypatch.setenv("COURSE_PROFILE", "full")
        monkeypatch.setattr(torch.cuda, "device_count", lambda: target.gpus_per_node)
        def setup(ranks=None, per_gpu=False, minimum=1, fallback="cpu", data=False):  # a notebook's first cell
            return plan_ranks(ranks, per_gpu, minimum, fallback, target.gpus_per_node) if ranks else None

        self.names = {"pick": sizing.pick, "plan_demo": plan_demo, "setup": setup, "max": max, "min": min,
                      "GPUS": target.gpus_per_node, "CPUS": target.cores_per_node}

    def _eval(self, expr: ast.expr, names: dict):
        code = compile(ast.fix_missing_locations(ast.Expression(expr)), "<notebook>", "eval")
        # one namespace (a comprehension sees it), no builtins beyond those named: the course's own notebooks
        return eval(code, {"__builtins__": {}, **self.names, **names})  # noqa: S307

    def pick(self, number: str, label: str, **names):
        return self._eval(picks(number)[label], names)

    def value(self, number: str, name: str, **names):
        return self._eval(assigned(number, name), names)


@pytest.fixture(params=TARGETS, ids=lambda t: t.name)
def full(request, monkeypatch):
    return Full(request.param, monkeypatch)


# --------------------------------------------------------------------------- #
# Models, memory, time
# --------------------------------------------------------------------------- #
@lru_cache
def model_facts(name: str) -> tuple[int, float, float]:
    """(parameters, training FLOPs per image, activation bytes per image in fp32) of a course model on
    CIFAR-sized images: convolutions and linear layers counted on a one-image forward (x2 for a
    multiply-add, x3 for forward + backward); activations: every layer's output, twice (autograd keeps
    inputs and outputs of the normalisations and activations beside them)."""
    model = build_model(name).eval()
    macs, outputs = [0], [0]

    def count(module, _inputs, out):
        if isinstance(module, torch.nn.Conv2d):
            macs[0] += out.numel() * module.in_channels // module.groups * math.prod(module.kernel_size)
        elif isinstance(module, torch.nn.Linear):
            macs[0] += out.numel() * module.in_features
        outputs[0] += out.numel()

    for m in model.modules():
        if not list(m.children()):
            m.register_forward_hook(count)
    with torch.no_grad():
        model(torch.zeros(1, 3, 32, 32))
    return count_parameters(model), 6.0 * macs[0], 2 * 4.0 * outputs[0]


def train_memory(model: str, batch: int, optimizer: str = "sgd") -> float:
    """Bytes one rank's GPU holds training ``model`` at ``batch``: fp32 weights, gradients and optimizer
    state (autocast keeps them fp32), fp32 activations (autocast's are smaller), the CUDA context."""
    params, _, act = model_facts(model)
    state = sum(bytes_per_param("fp32", optimizer).values()) * params
    return state + batch * act + CUDA_CONTEXT_BYTES


def fits(target, need_bytes: float) -> bool:
    return need_bytes <= MEMORY_MARGIN * target.gpu_memory_gib * GiB


def train_seconds(target, model: str, images_per_rank: float, batch: int, ranks: int, precision: str,
                  workers: int, val_images: float = 0, checkpoints: int = 0, compile: bool = False) -> float:
    """A run's seconds on ``target``: start-up, then per rank the compute at STEP_EFFICIENCY of the card
    (validation a third of a training step), DDP's all-reduce of the fp32 gradients every step, the data
    (overlapped by workers, in series without), and rank 0's checkpoints."""
    params, flops, _ = model_facts(model)
    rate = (target.tflops_fp32 if precision == "fp32" else target.tflops_amp) * 1e12 * STEP_EFFICIENCY
    compute = (images_per_rank + val_images / 3) * flops / rate
    steps = images_per_rank / batch
    comm = 0.0 if ranks == 1 else steps * 2 * (ranks - 1) / ranks * 4 * params / LINK_BYTES_PER_S
    data = (images_per_rank + val_images) / (max(workers, 1) * LOADER_IMAGES_PER_S)
    work = max(compute + comm, data) if workers else compute + comm + data
    per = bytes_per_param("fp32", "sgd")
    ckpt = checkpoints * (per["params"] + per["optimizer"]) * params / FS_BYTES_PER_S  # weights and momentum
    return STARTUP_S + (COMPILE_S if compile else 0) + work + ckpt


def resolved(target, precision: str) -> str:
    return precision_for(precision, "cuda", target.capability, target.gpu)


@lru_cache
def _config_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return parser


def config(flags) -> TrainConfig:
    """A TrainConfig from train.py's flags (a string or a list), the course's own parser."""
    known, _ = _config_parser().parse_known_args(shlex.split(flags) if isinstance(flags, str) else [str(f) for f in flags])
    return config_from_args(known)


@lru_cache
def script_module(name: str):
    spec = importlib.util.spec_from_file_location(name.removesuffix(".py"), SCRIPTS / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --------------------------------------------------------------------------- #
# The targets themselves
# --------------------------------------------------------------------------- #
@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_precision_follows_the_compute_capability(target):
    assert (tuple(target.capability) >= BF16_MIN_CAPABILITY) == target.bf16
    assert resolved(target, "amp") == ("bf16" if target.bf16 else "fp16")
    if not target.bf16:
        with pytest.raises(ValueError, match="no bf16"):
            resolved(target, "bf16")


@pytest.mark.parametrize("site", CLUSTERS)
def test_targets_agree_with_the_site_files(site):
    target = next(t for t in TARGETS if t.site == site)
    conf = tomllib.loads((REPO_ROOT / "slurm" / "sites" / f"{site}.toml").read_text())
    assert (conf["gpus_per_node"], conf["cores_per_node"]) == (target.gpus_per_node, target.cores_per_node)


# --------------------------------------------------------------------------- #
# Which test checks each full-profile value (a pick no test claims fails below)
# --------------------------------------------------------------------------- #
COVERED = {
    "00": {"n": "test_00_matmul", "rows / matmul_table() / repeats=": "test_00_matmul",
           "total_mib": "test_00_storage", "small_kib": "test_00_storage"},
    "01": {"MODEL": "test_01_single_device", "N_TRAIN": "test_01_single_device", "N_VAL": "test_01_single_device",
           "EPOCHS": "test_01_single_device", "BATCH": "test_01_single_device", "if / step ==": "test_01_single_device",
           "if / step == #2": "test_01_single_device",
           "settings / LadderSettings() / steps=": "test_01_single_device",
           "settings / LadderSettings() / untimed_steps=": "test_01_single_device",
           "settings / LadderSettings() / compile_on_cpu=": "test_01_single_device",
           "settings / LadderSettings() / workers= / min()": "test_01_single_device",
           "peaks / matmul_table() / n=": "test_01_single_device",
           "peaks / matmul_table() / repeats=": "test_01_single_device",
           "(trace, top_ops) / profile_steps(runs/01_profile) / active=": "test_01_single_device",
           "args / --n-train / str()": "test_01_script_timeout",
           "run / run_script(train.py) / timeout_s=": "test_01_script_timeout"},
    "02": {"SESSION / setup() / per_gpu=": "test_02_collectives",
           "run / run_script(allreduce_bench.py) / --max-mib": "test_02_collectives",
           "run / run_script(allreduce_bench.py) / --iters": "test_02_collectives",
           "expr / run_script(allreduce_bench.py) / --max-mib": "test_02_collectives",
           "expr / run_script(allreduce_bench.py) / --iters": "test_02_collectives",
           "run / run_script(param_server.py) / --mib": "test_02_collectives",
           "run / run_script(param_server.py) / --steps": "test_02_collectives",
           "run / run_script(param_server.py) / --compute-ms": "test_02_collectives"},
    "03": {"MODEL": "test_03_ddp", "SESSION / setup() / per_gpu=": "test_03_ddp",
           "args / --epochs": "test_03_ddp", "args / --n-train": "test_03_ddp", "args / --n-val": "test_03_ddp",
           "args / --batch-size": "test_03_ddp", "run / run_script(train.py) / timeout_s=": "test_03_ddp",
           "EPOCHS": "test_03_lr_scaling", "(train_ds, val_ds, info) / get_datasets(synthetic) / n_train=":
               "test_03_lr_scaling", "(train_ds, val_ds, info) / get_datasets(synthetic) / n_val=": "test_03_lr_scaling",
           "run / run_script(ddp_buckets.py) / --steps": "test_03_checks_and_buckets",
           "run / run_script(ddp_buckets.py) / --batch-size": "test_03_checks_and_buckets",
           "batch": "test_03_scaling", "steps": "test_03_scaling",
           "PLAIN_ARGS / --epochs": "test_03_plain", "PLAIN_ARGS / --n-train": "test_03_plain",
           "PLAIN_ARGS / --workers": "test_03_plain"},
    "04": {"TRAIN_ARGS": "test_04_jobs", "records / slurm.wait() / timeout_s=": "test_04_jobs",
           "rec / slurm.wait() / timeout_s=": "test_04_jobs", "SWEEP_ARGS": "test_04_jobs",
           "tasks / slurm.wait() / timeout_s=": "test_04_jobs", "one_rec / slurm.wait() / timeout_s=": "test_04_jobs",
           "ONE_FILE_ARGS": "test_04_plain_jobs", "plain / TRAIN_ARGS:": "test_04_plain_jobs"},
    "05": {"return / --epochs": "test_05_fault_tolerance", "return / --n-train": "test_05_fault_tolerance",
           "return / --model": "test_05_fault_tolerance", "elastic_args": "test_05_fault_tolerance",
           "plain_args / --epochs": "test_05_plain", "plain_args / --n-train": "test_05_plain",
           "REQUEUE_EPOCHS": "test_05_plain", "REQUEUE_ARGS / TRAIN_ARGS:": "test_05_plain"},
    "06": {"PLAN / plan_demo() / wanted=": "test_06_lightning", "EPOCHS": "test_06_lightning",
           "timeout": "test_06_lightning", "N_TRAIN": "test_06_lightning", "BATCH": "test_06_lightning",
           "ARGS / --model": "test_06_lightning", "ARGS / --n-val": "test_06_lightning",
           "ARGS / --workers": "test_06_lightning", "ARGS / --precision": "test_06_lightning",
           "out / --log-every": "test_06_log_every"},
    "07": {"PLAN / plan_demo() / wanted=": "test_07_zero", "BATCH": "test_07_zero", "timeout": "test_07_zero",
           "ARGS / --n-train": "test_07_zero", "ARGS / --n-val": "test_07_zero", "ARGS / --workers": "test_07_zero",
           "LM_ARGS / --lm-size": "test_07_transformer", "LM_ARGS / --seq-len": "test_07_transformer",
           "LM_ARGS / --steps": "test_07_transformer", "(AC_SIZE, AC_BATCH, AC_SEQ)": "test_07_transformer"},
    "08": {"SAMPLES": "test_08_tune", "BASE / TrainConfig() / epochs=": "test_08_tune",
           "BASE / TrainConfig() / n_train=": "test_08_tune", "BASE / TrainConfig() / n_val=": "test_08_tune",
           "(bad_loss, bad_acc) / tuning.held_out_score()": "test_08_tune",
           "(s['held_out_loss'], s['held_out_acc']) / tuning.held_out_score()": "test_08_tune",
           "(_, s['held_out_acc']) / tuning.held_out_score()": "test_08_tune",
           "POPULATION": "test_08_tune", "pbt_base / TrainConfig() / ** / epochs:": "test_08_tune",
           "ddp_base / TrainConfig() / ** / epochs:": "test_08_tune"},
    "09": {"pipe_run / run_script(train_pipeline.py) / timeout_s=": "test_09_pipeline",
           "TP_SHAPE": "test_09_tensor_parallel", "tp_run / run_script(train_tp.py) / timeout_s=":
               "test_09_tensor_parallel",
           "rpc_run / run_script(rpc_param_server.py) / --steps": "test_09_rpc",
           "expr / check_param_server() / steps=": "test_09_rpc",
           "LM_ARGS / --lm-size": "test_09_transformer", "LM_ARGS / --seq-len": "test_09_transformer",
           "LM_ARGS / --steps": "test_09_transformer"},
    "10": {"N_IMAGES": "test_10_formats", "BATCH": "test_10_formats",
           "parts / step_breakdown() / steps=": "test_10_formats",
           "run / emulate_training() / steps=": "test_10_emulated_steps",
           "run / emulate_training() / steps= #2": "test_10_emulated_steps",
           "TRAIN_ARGS": "test_10_staging_job", "shard_command / -n / str()": "test_10_staging_job",
           "shard_command / --n-val / str()": "test_10_staging_job",
           "rec / slurm.wait() / timeout_s=": "test_10_staging_job"},
    "11": {"TIMEOUT_S": "test_11_hang", "BATCH": "test_11_memory"},
    "12": {"LM_ARGS / --lm-size": "test_12_long_sequences_and_experts",
           "LM_ARGS / --seq-len": "test_12_long_sequences_and_experts",
           "LM_ARGS / --steps": "test_12_long_sequences_and_experts", "TEXT_BYTES": "test_12_long_sequences_and_experts"},
}


def test_every_full_profile_value_is_checked():
    numbers = sorted(p.name[:2] for p in NOTEBOOKS.glob("[01][0-9]_*.ipynb"))
    assert numbers == sorted(COVERED), "a notebook was added or removed: say here which test checks its picks"
    for number in numbers:
        found, claimed = set(picks(number)), set(COVERED[number])
        assert found - claimed == set(), f"notebook {number}: full-profile values no test checks: {found - claimed}"
        assert claimed - found == set(), f"notebook {number}: COVERED names picks the notebook no longer has"
        assert set(COVERED[number].values()) <= set(globals()), f"notebook {number}: a test named in COVERED is missing"


# --------------------------------------------------------------------------- #
# 00 environment
# --------------------------------------------------------------------------- #
def test_00_matmul(full):
    n = full.pick("00", "n", device="cuda")
    repeats = full.pick("00", "rows / matmul_table() / repeats=")
    # cell 6 checks tensor cores only from some size on (small matmuls are launch-bound): the full size reaches it
    (threshold,) = [node.comparators[0].value for tree in cells("00") for node in ast.walk(tree)
                    if isinstance(node, ast.Compare) and ast.unparse(node.left) == "n"]
    assert n >= threshold
    assert fits(full.target, 3 * n * n * 4 + CUDA_CONTEXT_BYTES), "A, B and the product in fp32"
    # every format at the fp32 rate (errs slow): repeats x (2 n^3), 4 formats, within a minute
    assert repeats * 4 * 2 * n**3 / (full.target.tflops_fp32 * 1e12 * STEP_EFFICIENCY) < 60


def test_00_storage(full):
    total_mib, small_kib = full.value("00", "total_mib"), full.value("00", "small_kib")
    assert total_mib * 1024 % small_kib == 0 and total_mib * 1024 // small_kib >= 2, "whole small files, many"


# --------------------------------------------------------------------------- #
# 01 single device (cuda:0 on every target)
# --------------------------------------------------------------------------- #
def test_01_single_device(full):
    t = full.target
    model, batch = full.value("01", "MODEL"), full.value("01", "BATCH")
    n_train, n_val, epochs = full.value("01", "N_TRAIN"), full.value("01", "N_VAL"), full.value("01", "EPOCHS")
    assert model in ("resnet18", "cnn") and epochs >= 2
    assert fits(t, train_memory(model, batch)) and fits(t, train_memory(model, 2 * batch)), "train, and validate at 2B"
    # where CIFAR-10 was downloaded the notebook trains on it: it holds 50,000 training and 10,000 test images
    assert n_train <= 50_000 and 2 * batch <= n_val <= 10_000, "the sizes fit CIFAR-10, validation a batch at least"
    assert full.pick("01", "if / step ==") < n_train // batch, "cell 3 stops inside the first epoch"
    assert full.pick("01", "if / step == #2") < n_train // batch, "so does the loop with every rung on"
    steps = full.pick("01", "settings / LadderSettings() / steps=")
    untimed = full.pick("01", "settings / LadderSettings() / untimed_steps=")
    workers = min(full.pick("01", "settings / LadderSettings() / workers= / min()"), t.cores_per_node)
    assert steps >= 10 and 1 <= untimed < steps and 1 <= workers <= t.cores_per_node
    assert isinstance(full.pick("01", "settings / LadderSettings() / compile_on_cpu="), bool)  # a CPU-only switch
    n = full.pick("01", "peaks / matmul_table() / n=", device=torch.device("cuda"))
    repeats = full.pick("01", "peaks / matmul_table() / repeats=")
    assert fits(t, 3 * n * n * 4 + CUDA_CONTEXT_BYTES) and repeats >= 3
    assert 1 <= full.pick("01", "(trace, top_ops) / profile_steps(runs/01_profile) / active=") <= steps


def test_01_script_timeout(full):
    t = full.target
    model, batch = full.value("01", "MODEL"), full.value("01", "BATCH")
    n_train = int(full.pick("01", "args / --n-train / str()"))
    # train.py runs the ladder's best rungs: AMP, the ladder's workers, torch.compile (the slowest case)
    workers = min(full.pick("01", "settings / LadderSettings() / workers= / min()"), t.cores_per_node)
    estimate = train_seconds(t, model, 2 * n_train, batch, 1, resolved(t, "amp"), workers, val_images=2 * 512,
                             checkpoints=2, compile=True)  # two epochs, a checkpoint after each
    assert full.pick("01", "run / run_script(train.py) / timeout_s=") >= TIMEOUT_MARGIN * estimate


# --------------------------------------------------------------------------- #
# 02 processes and collectives
# --------------------------------------------------------------------------- #
def test_02_collectives(full):
    t = full.target
    plan = full.value("02", "SESSION")
    assert plan.nproc >= 2 and (plan.device == "cpu" or plan.nproc <= t.gpus_per_node)
    timeouts = call_keywords("02", "run_script('allreduce_bench.py'", "timeout_s")
    for cell, timeout in zip(("run", "expr"), timeouts, strict=True):
        max_mib = full.pick("02", f"{cell} / run_script(allreduce_bench.py) / --max-mib")
        iters = full.pick("02", f"{cell} / run_script(allreduce_bench.py) / --iters")
        # the sizes double up to max_mib (their sum < 2x the largest), ring and built-in, at gloo's CPU rate (the
        # 1-GPU targets run on the CPU at these sizes; cell 14 is gloo beside NCCL): one rank sends 2(n-1)/n x S
        n = plan.nproc
        sent = iters * 2 * (2 * max_mib * 2**20) * 2 * (n - 1) / n
        assert timeout >= TIMEOUT_MARGIN * (STARTUP_S + sent / GLOO_BYTES_PER_S)
        assert fits(t, 4 * max_mib * 2**20 + CUDA_CONTEXT_BYTES), "buffer, ring chunks, result"
    mib = full.pick("02", "run / run_script(param_server.py) / --mib")
    steps = full.pick("02", "run / run_script(param_server.py) / --steps")
    ranks = max(plan.nproc, 4)  # the cell's nproc; param_server.py runs on the CPU (gloo) whatever the node has
    # the synchronous server, the busiest: every worker's gradient in and the weights out, each step, and the
    # straggler's compute; three schemes
    compute_s = full.pick("02", "run / run_script(param_server.py) / --compute-ms") / 1000 * flag_constant("02", "--straggler")
    per_step = 2 * (ranks - 1) * mib * 2**20 / GLOO_BYTES_PER_S + compute_s
    (timeout,) = call_keywords("02", "run_script('param_server.py'", "timeout_s")
    assert timeout >= TIMEOUT_MARGIN * (STARTUP_S + 3 * steps * per_step)


# --------------------------------------------------------------------------- #
# 03 DDP on one node
# --------------------------------------------------------------------------- #
def optimised_workers(target, on_gpu: bool, ranks: int, monkeypatch) -> int:
    """The DataLoader workers scaling.optimised_args gives each rank on ``target``'s node."""
    from course_utils import hardware, scaling

    monkeypatch.setattr(hardware, "usable_cores", lambda: target.cores_per_node)
    return config(scaling.optimised_args(on_gpu, ranks)).workers


def _plan03(full):
    plan = full.value("03", "SESSION")
    assert plan.device == "cpu" or plan.nproc <= full.target.gpus_per_node, "never two NCCL ranks on one GPU"
    return plan


def test_03_ddp(full, monkeypatch):
    t, plan = full.target, _plan03(full)
    workers = optimised_workers(t, plan.device == "cuda", plan.nproc, monkeypatch)
    names = {"DEVICE": plan.device}
    model = full.value("03", "MODEL", **names)
    epochs, n_train, n_val, batch = (full.pick("03", f"args / {flag}", **names)
                                     for flag in ("--epochs", "--n-train", "--n-val", "--batch-size"))
    timeout = full.pick("03", "run / run_script(train.py) / timeout_s=", **names)
    assert n_train // plan.nproc // batch >= 1
    if plan.device == "cuda":
        assert fits(t, train_memory(model, batch)) and workers * plan.nproc <= t.cores_per_node
        estimate = train_seconds(t, model, epochs * n_train / plan.nproc, batch, plan.nproc, resolved(t, "amp"),
                                 workers, val_images=epochs * n_val)
        assert timeout >= TIMEOUT_MARGIN * estimate
    # COURSE_DIST_TIMEOUT=300: the longest a rank waits in a collective is rank 0's epoch-end work
    # (validation, checkpoint); it must outlast that
    dist_timeout = int(next(ast.literal_eval(k.value)["COURSE_DIST_TIMEOUT"] for tree in cells("03")
                            for k in ast.walk(tree) if isinstance(k, ast.keyword) and k.arg == "env"
                            and "COURSE_DIST_TIMEOUT" in ast.unparse(k.value)))
    if plan.device == "cuda":
        val_s = train_seconds(t, model, 0, batch, 1, resolved(t, "amp"), workers, val_images=n_val) - STARTUP_S
        assert dist_timeout >= TIMEOUT_MARGIN * val_s


def _plain_defaults() -> dict[str, int]:
    """plain_resumable.py's defaults (plain_ddp.py's and plain_single.py's are the same), read from its argparse."""
    text = (SCRIPTS / "plain_resumable.py").read_text()
    return {flag: int(value) for flag, value in re.findall(r'"(--[a-z-]+)", type=int, default=(\d+)', text)}


def _plain_steps(flags: list, ranks: int) -> int:
    """Optimiser steps an epoch of a plain script takes on ``ranks`` ranks, with ``flags`` over its defaults."""
    given = dict(zip(flags[::2], flags[1::2]))
    args = {**_plain_defaults(), **{k: int(v) for k, v in given.items() if k in _plain_defaults()}}
    return args["--n-train"] // ranks // args["--batch-size"]


def test_03_plain(full):
    plan = _plan03(full)
    flags = [f for label in ("--epochs", "--n-train", "--workers") for f in
             (label, full.pick("03", f"PLAIN_ARGS / {label}", DEVICE=plan.device))]
    assert flags[1] >= 2, "the loss falls over the epochs: two at least"
    assert _plain_steps(flags, plan.nproc) >= 2, "every rank takes steps each epoch, a 1/N share of one device's"
    assert flags[5] * plan.nproc <= full.target.cores_per_node, "DataLoader workers for every rank"


@pytest.mark.parametrize("target", [t for t in TARGETS if t.site], ids=lambda t: t.name)
def test_04_plain_jobs(target, monkeypatch):
    """The one-file job (its own flags at full size) and plain_ddp.py through the site's srun pattern."""
    full = Full(target, monkeypatch)
    one_file = slurm.sbatch_options(REPO_ROOT / "slurm" / "ddp_one_file.sbatch")
    flags = full.value("04", "ONE_FILE_ARGS").get("TRAIN_ARGS", "--epochs 3").split()
    ranks = int(one_file["--nodes"]) * int(one_file["--ntasks-per-node"])
    assert _plain_steps(flags, ranks) >= 2 and _plain_defaults()["--workers"] <= int(one_file["--cpus-per-task"])
    gpus, _, options = slurm.site_scripts()[target.site]
    flags = full.pick("04", "plain / TRAIN_ARGS:").split()
    assert _plain_steps(flags, 2 * gpus) >= 2, "plain_ddp.py on 2 nodes: every rank takes steps"
    assert _plain_defaults()["--workers"] <= int(options["--cpus-per-task"]), "workers within a task's cores"


def test_05_plain(full):
    plan = full.value("05", "SESSION")  # the killed run's 2 ranks
    flags = [f for label in ("--epochs", "--n-train") for f in
             (label, full.pick("05", f"plain_args / {label}", DEVICE=plan.device))]
    assert flags[1] >= 2 and _plain_steps(flags, 2) > 3, "a checkpoint every 3 steps falls inside an epoch"
    epochs = full.value("05", "REQUEUE_EPOCHS")
    requeue = full.value("05", "REQUEUE_ARGS", REQUEUE_EPOCHS=epochs)["TRAIN_ARGS"].split()
    assert requeue[:2] == ["--epochs", str(epochs)] and epochs >= 2, "the check reads the epochs the job trains"
    one_file = slurm.sbatch_options(REPO_ROOT / "slurm" / "ddp_requeue_one_file.sbatch")
    ranks = int(one_file["--nodes"]) * int(one_file["--ntasks-per-node"])
    assert _plain_steps(requeue, ranks) >= 2


def test_03_lr_scaling(full):
    small, big = full.value("03", "SMALL"), full.value("03", "BIG")
    epochs = full.value("03", "EPOCHS")
    n_train = full.pick("03", "(train_ds, val_ds, info) / get_datasets(synthetic) / n_train=")
    n_val = full.pick("03", "(train_ds, val_ds, info) / get_datasets(synthetic) / n_val=")
    assert big % small == 0 and epochs >= 2, "an integer scale factor; the warm-up epoch leaves epochs to compare"
    assert n_val >= 1024, "the full profile reports its validation accuracy on 1,024 images or more"
    assert n_train // big >= 10, "the big batch still takes steps each epoch"
    assert fits(full.target, train_memory("cnn", big))


def test_03_checks_and_buckets(full):
    _plan03(full)
    buckets = plan_demo(2, full.target.gpus_per_node)  # the cell's own call: 2 ranks
    assert buckets.device == "cpu" or buckets.nproc <= full.target.gpus_per_node
    steps = full.value("03", "CHECK_STEPS")
    (checks_timeout,) = call_keywords("03", "run_script('ddp_checks.py'", "timeout_s")
    (buckets_timeout,) = call_keywords("03", "run_script('ddp_buckets.py'", "timeout_s")
    # ddp_checks.py: the course's CNN, a few images a step, steps x 2 runs, on any device: start-up dominates
    assert checks_timeout >= TIMEOUT_MARGIN * (STARTUP_S + 2 * steps * 0.1)
    b_steps = full.pick("03", "run / run_script(ddp_buckets.py) / --steps", BUCKETS=buckets)
    b_batch = full.pick("03", "run / run_script(ddp_buckets.py) / --batch-size", BUCKETS=buckets)
    assert steps >= 2 and b_steps >= 1
    if buckets.device == "cuda":
        assert fits(full.target, train_memory("resnet18", b_batch))  # ddp_buckets.py's model
        # 6 measurements of b_steps steps (2 of them x4 micro-batches) of ResNet-18 in fp32
        est = train_seconds(full.target, "resnet18", 14 * b_steps * b_batch, b_batch, 2, "fp32", 0)
        assert buckets_timeout >= TIMEOUT_MARGIN * est


def test_03_scaling(full, monkeypatch):
    t, plan = full.target, _plan03(full)
    names = {"DEVICE": plan.device}
    batch, steps = full.value("03", "batch", **names), full.value("03", "steps", **names)
    world_sizes = full.value("03", "world_sizes", N=plan.nproc)
    glob = full.value("03", "GLOBAL", batch=batch)
    assert all(glob % n == 0 for n in world_sizes), "strong scaling splits the global batch exactly"
    if plan.device == "cuda":
        assert fits(t, train_memory(full.value("03", "MODEL", **names), glob)), "the 1-rank strong step's batch"
        workers = optimised_workers(t, True, max(world_sizes), monkeypatch)
        est = train_seconds(t, full.value("03", "MODEL", **names), batch * (steps + 2), batch, max(world_sizes),
                            resolved(t, "amp"), workers)
        timeouts = call_keywords("03", "measure_scaling(", "timeout_s")
        assert len(timeouts) == 2 and min(timeouts) >= TIMEOUT_MARGIN * est, "weak and strong scaling, each run"


# --------------------------------------------------------------------------- #
# Slurm: the generated scripts on each site
# --------------------------------------------------------------------------- #
def site_script(site: str, pattern: str) -> tuple[str, dict[str, str]]:
    path = REPO_ROOT / "slurm" / site / f"{pattern}.sbatch"
    return path.read_text(), slurm.sbatch_options(path)


def script_gpus_per_node(text: str) -> int | None:
    """GPUS_PER_NODE as a script sets it (``4``, or ``"${SLURM_GPUS_ON_NODE:-2}"``: its default), if it does."""
    found = re.search(r'^GPUS_PER_NODE="?(?:\$\{SLURM_GPUS_ON_NODE:-)?(\d+)', text, re.M)
    return int(found.group(1)) if found else None


def per_node(site: str, pattern: str) -> tuple[int, int, int]:
    """(GPUs a job holds per node, ranks per node, cores per rank) of a site's pattern."""
    text, opts = site_script(site, pattern)
    target = next(t for t in TARGETS if t.site == site)
    gres = opts.get("--gres", "")
    gpus = int(gres.rsplit(":", 1)[1]) if gres else target.gpus_per_node  # no --gres: whole nodes
    tasks, cpus = int(opts["--ntasks-per-node"]), int(opts["--cpus-per-task"])
    script_gpus = script_gpus_per_node(text) or gpus
    assert script_gpus == target.gpus_per_node
    if "torchrun --standalone --nproc-per-node=1" in text:  # the sweep: TRIALS_PER_TASK one-GPU trials
        ranks = int(re.search(r"^TRIALS_PER_TASK=(\d+)", text, re.M).group(1)) * tasks
    elif re.search(r'torchrun .*--nproc-per-node="\$GPUS_PER_NODE"', text):
        ranks = script_gpus * tasks
    else:
        ranks = tasks
    return gpus, ranks, tasks * cpus // ranks


def default_train_args(site: str, pattern: str) -> str:
    text, opts = site_script(site, pattern)
    found = re.search(r'TRAIN_ARGS="\$\{TRAIN_ARGS---(.*)\}"', text)
    if found:
        args = "--" + found.group(1)
    else:  # train.py's, from the library every script sources
        lib = (REPO_ROOT / "slurm" / "lib" / "course_job.sh").read_text()
        args = "--" + re.search(r'TRAIN_ARGS="\$\{TRAIN_ARGS:---(.*)\}"', lib).group(1)
    if "$((SLURM_CPUS_PER_TASK / GPUS_PER_NODE))" in args:  # the Ray pattern's cores per trial
        per_trial = int(opts["--cpus-per-task"]) // script_gpus_per_node(text)
        args = args.replace("$((SLURM_CPUS_PER_TASK / GPUS_PER_NODE))", str(per_trial))
    return args


def hours(limit: str) -> float:
    h, m, s = (int(x) for x in limit.split(":"))
    return h + m / 60 + s / 3600


PATTERNS = ("one_node", "multi_node_srun", "multi_node_torchrun", "sweep_array", "requeue", "multi_node_lightning",
            "multi_node_deepspeed", "multi_node_2d", "multi_node_ray")
@pytest.mark.parametrize("site, pattern", [(s, p) for s in CLUSTERS for p in PATTERNS])
def test_slurm_pattern_on_its_site(site, pattern):
    target = next(t for t in TARGETS if t.site == site)
    _, opts = site_script(site, pattern)
    gpus, ranks, cores_per_rank = per_node(site, pattern)
    assert int(opts["--nodes"]) <= target.nodes and gpus <= target.gpus_per_node
    assert int(opts["--ntasks-per-node"]) * int(opts["--cpus-per-task"]) <= target.cores_per_node
    flags = default_train_args(site, pattern)
    limit_s = 3600 * hours(opts["--time"])
    if pattern == "multi_node_ray":
        tune = script_module("tune.py").build_parser().parse_known_args(shlex.split(flags))[0]
        cfg = config_from_args(tune)
        slots = trials_per_node(int(opts["--cpus-per-task"]), gpus, tune.cpus_per_trial, tune.gpus_per_trial)
        assert slots >= 1 and cfg.workers <= tune.cpus_per_trial
        rounds = math.ceil(tune.num_samples / (slots * int(opts["--nodes"])))  # every trial to the end (FIFO)
        assert cfg.dataset == "cifar10"
        per_trial = train_seconds(target, cfg.model, cfg.epochs * CIFAR10_TRAIN, cfg.batch_size, 1,
                                  resolved(target, cfg.precision), cfg.workers, val_images=cfg.epochs * CIFAR10_TEST)
        assert limit_s >= TIMEOUT_MARGIN * rounds * per_trial
        return
    if pattern == "multi_node_2d":
        tp = script_module("train_tp.py").build_parser().parse_args(shlex.split(flags))
        world = int(opts["--nodes"]) * ranks
        assert ranks <= gpus and world % gpus == 0 and tp.heads % gpus == 0 and 4 * tp.hidden % gpus == 0
        assert tp.hidden % tp.heads == 0 and tp.seq % gpus == 0
        return
    assert ranks <= gpus, "one rank per GPU"
    cfg = config(flags)
    assert cfg.workers <= cores_per_rank
    precision = resolved(target, cfg.precision)  # raises where the GPU cannot
    if cfg.model != "mlp":
        assert fits(target, train_memory(cfg.model, cfg.batch_size, cfg.optimizer))
    world = ranks * int(opts["--nodes"]) if pattern != "sweep_array" else 1
    assert cfg.dataset == "synthetic"
    n_train, n_val = synthetic_sizes()
    est = train_seconds(target, cfg.model, cfg.epochs * (cfg.n_train or n_train) / world, cfg.batch_size, world,
                        precision, cfg.workers, val_images=cfg.epochs * (cfg.n_val or n_val))
    assert limit_s >= TIMEOUT_MARGIN * est


# --------------------------------------------------------------------------- #
# 04 many nodes with Slurm: the jobs a cell submits (slurm.TIME_LIMIT each)
# --------------------------------------------------------------------------- #
def job_seconds(target, flags, pattern: str, n_train: int | None = None) -> float:
    cfg = config(flags)
    _, ranks, cores_per_rank = per_node(target.site, pattern)
    nodes = int(site_script(target.site, pattern)[1]["--nodes"])
    world = ranks * nodes if pattern != "sweep_array" else 1
    assert ranks <= target.gpus_per_node and cfg.workers <= cores_per_rank
    assert fits(target, train_memory(cfg.model, cfg.batch_size, cfg.optimizer))
    n, n_val = n_train or cfg.n_train or synthetic_sizes()[0], cfg.n_val or synthetic_sizes()[1]
    return train_seconds(target, cfg.model, cfg.epochs * n / world, cfg.batch_size, world,
                         resolved(target, cfg.precision), cfg.workers, val_images=cfg.epochs * n_val)


@pytest.mark.parametrize("target", [t for t in TARGETS if t.site], ids=lambda t: t.name)
def test_04_jobs(target, monkeypatch):
    full = Full(target, monkeypatch)
    limit_s = 3600 * hours(slurm.TIME_LIMIT)
    train_args = full.value("04", "TRAIN_ARGS")
    sweep_args = full.value("04", "SWEEP_ARGS", TRAIN_ARGS=train_args)
    for pattern in ("one_node", "multi_node_srun", "multi_node_torchrun"):
        assert limit_s >= TIMEOUT_MARGIN * job_seconds(target, train_args, pattern)
    assert limit_s >= TIMEOUT_MARGIN * job_seconds(target, sweep_args, "sweep_array")
    # a wait must outlast the job it waits for (its queueing aside)
    for label in ("records / slurm.wait() / timeout_s=", "tasks / slurm.wait() / timeout_s="):
        assert full.pick("04", label) >= limit_s
    assert full.pick("04", "rec / slurm.wait() / timeout_s=") >= limit_s, "plain_ddp.py's job"
    assert full.pick("04", "one_rec / slurm.wait() / timeout_s=") >= limit_s, "the one-file job's"


# --------------------------------------------------------------------------- #
# 05 fault tolerance
# --------------------------------------------------------------------------- #
def test_05_fault_tolerance(full):
    t = full.target
    plan = full.value("05", "SESSION")  # section 2: 2 ranks
    (body,) = [r.value for tree in cells("05") for f in ast.walk(tree)
               if isinstance(f, ast.FunctionDef) and f.name == "train_args"
               for r in ast.walk(f) if isinstance(r, ast.Return)]
    args = full._eval(body, {"device": plan.device})  # train_args(DEVICE): the list the notebook builds
    cfg = config(args)
    every = next(n.elts[-1].value for tree in cells("05") for n in ast.walk(tree)
                 if isinstance(n, ast.List) and "--ckpt-every-steps" in ast.unparse(n))
    (inspect_timeout, reference_timeout) = call_keywords("05", "run_script('train.py'", "timeout_s")
    (killed_timeout,) = call_keywords("05", "job.wait(", "timeout_s")
    if plan.device == "cuda":
        assert fits(t, train_memory(cfg.model, cfg.batch_size))
        steps = cfg.epochs * math.ceil(cfg.n_train / 2 / cfg.batch_size)  # per rank, 2 ranks
        # section 2: a 2-rank run of every epoch in fp32 with deterministic kernels, rank 0 checkpointing
        # every few steps (the killed run repeats it, restart included)
        est = train_seconds(t, cfg.model, cfg.epochs * cfg.n_train / 2, cfg.batch_size, 2, "fp32", cfg.workers,
                            checkpoints=steps // every)
        assert min(reference_timeout, killed_timeout) >= TIMEOUT_MARGIN * est, f"{steps // every} checkpoints"
        one = train_seconds(t, cfg.model, cfg.n_train, cfg.batch_size, 1, "fp32", cfg.workers)  # section 1: 1 epoch
        assert inspect_timeout >= TIMEOUT_MARGIN * one
        if t.site:  # section 4's requeued job: the cell's epochs on the site's requeue pattern, 15-minute limit
            (requeue_epochs,) = [e.elts[1].value for tree in cells("05") for e in ast.walk(tree)
                                 if isinstance(e, ast.List) and len(e.elts) == 3
                                 and ast.unparse(e.elts[0]) == "*ARGS[:1]"]
            job = [args[0], requeue_epochs, *args[2:]]
            assert 3600 * hours(slurm.TIME_LIMIT) >= TIMEOUT_MARGIN * job_seconds(t, job, "requeue")
    # section 3 runs on the CPU (both "nodes" are this machine): pick's device="cpu" gives a GPU session CI sizes
    elastic = full.pick("05", "elastic_args")
    assert elastic >= 2, "node 2 dies after the first checkpoint: epochs must remain for node 1"


# --------------------------------------------------------------------------- #
# 06 Lightning and Fabric
# --------------------------------------------------------------------------- #
def _lightning(full):
    plan = full.value("06", "PLAN")
    names = {"DEVICE": plan.device}
    return plan, names, full.value("06", "EPOCHS", **names), full.value("06", "N_TRAIN", **names), \
        full.value("06", "BATCH", **names)


def _steps_per_epoch(n_train: int, batch: int, nproc: int) -> int:
    """Lightning's optimiser steps an epoch without accumulation: each rank's slice, whole batches (drop_last)."""
    return len(make_loader(range(n_train), batch, shuffle=True, drop_last=True, replica=(0, nproc)))


def test_06_lightning(full):
    t = full.target
    plan, names, epochs, n_train, batch = _lightning(full)
    assert plan.device == "cpu" or plan.nproc <= t.gpus_per_node
    model = full.pick("06", "ARGS / --model", **names)
    n_val, workers = full.pick("06", "ARGS / --n-val", **names), full.pick("06", "ARGS / --workers", **names)
    precision = full.pick("06", "ARGS / --precision", **names)
    timeout = full.value("06", "timeout", **names)
    assert _steps_per_epoch(n_train, batch, plan.nproc) >= 1, "every rank takes a step"
    assert epochs >= 2, "a run, then its resumption for the last epoch"
    if plan.device == "cuda":
        assert workers * plan.nproc <= t.cores_per_node
        assert fits(t, train_memory(model, batch))
        first = train_seconds(t, model, (epochs - 1) * n_train / plan.nproc, batch, plan.nproc,
                              resolved(t, precision), workers, val_images=(epochs - 1) * n_val)
        pair = full.value("06", "COMPARE_N", N=plan.nproc)  # sections 6-7: four trainers, fp32, deterministic
        compare = train_seconds(t, model, epochs * n_train / pair, batch, pair, "fp32", workers,
                                val_images=epochs * n_val)
        assert timeout >= TIMEOUT_MARGIN * max(first, compare)


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
def test_06_log_every(target, monkeypatch):
    full = Full(target, monkeypatch)
    plan, names, epochs, n_train, batch = _lightning(full)
    every = full.pick("06", "out / --log-every", **names)
    per_epoch = _steps_per_epoch(n_train, batch, plan.nproc)
    first, second = (epochs - 1) * per_epoch, epochs * per_epoch
    # Lightning logs after steps every, 2 every, ...: the chart needs a point from each run
    assert first >= every, f"the first run takes {first} steps, logging every {every}"
    assert second // every > first // every


# --------------------------------------------------------------------------- #
# 07 DeepSpeed and FSDP2
# --------------------------------------------------------------------------- #
def test_07_zero(full):
    t = full.target
    plan = full.value("07", "PLAN")
    assert plan.device == "cpu" or plan.nproc <= t.gpus_per_node
    names = {"DEVICE": plan.device}
    batch, accum = full.value("07", "BATCH", **names), full.value("07", "ACCUM", **names)
    n_train, n_val = full.pick("07", "ARGS / --n-train", **names), full.pick("07", "ARGS / --n-val", **names)
    workers = full.pick("07", "ARGS / --workers", **names)
    # cell 19 resumes N ranks' checkpoint on 1 and checks the step count exactly: whole steps on N and on 1
    for world in (plan.nproc, 1):
        assert n_train % (world * batch * accum) == 0, f"{n_train} images, {world} rank(s) x {batch} x {accum}"
    if plan.device == "cuda":
        assert workers * plan.nproc <= t.cores_per_node
        precision = full.value("07", "PRECISION", **names)
        amp = resolved(t, precision)  # amp on a GPU: bf16 or fp16 from the compute capability
        fsdp_precision(precision, amp)  # train_fsdp.py: fp32 in place of fp16, with a note; never a refusal
        assert fits(t, train_memory("mlp", batch, "adamw"))  # stage 0 holds it all
        epochs = full.value("07", "EPOCHS")
        est = train_seconds(t, "mlp", epochs * n_train / plan.nproc, batch, plan.nproc, amp, workers,
                            val_images=epochs * n_val)
        assert full.value("07", "timeout", **names) >= TIMEOUT_MARGIN * est


def lm_train_memory(size: str, batch: int, seq: int) -> float:
    """Bytes a GPU holds training the decoder in fp32 with AdamW at ``batch`` x ``seq`` tokens, unsharded: 16 bytes
    per parameter, each block's activations as Korthikanti et al. (2022) count them in 16 bits (34 bytes per
    token and width; attention's scores left out: SDPA never holds them), doubled for fp32, the logits, the
    CUDA context."""
    from course_utils.llama import LM_SIZES, parameter_counts

    shape = LM_SIZES[size]
    state = 16 * sum(parameter_counts(shape).values())
    activations = shape.layers * 2 * 34 * batch * seq * shape.dim + 3 * 4 * batch * seq * shape.vocab
    return state + activations + CUDA_CONTEXT_BYTES


def test_07_transformer(full):
    """Section 6's decoder: 16 sequences a step dealt evenly to the ranks, one process's step (and the kernel's
    activation-checkpointing step, unsplit) within the card, the steps within the timeout."""
    from course_utils.llama import LM_SIZES, flops_per_token

    t, plan = full.target, full.value("07", "PLAN")
    names = {"DEVICE": plan.device}
    size, seq = full.pick("07", "LM_ARGS / --lm-size", **names), full.pick("07", "LM_ARGS / --seq-len", **names)
    steps = full.pick("07", "LM_ARGS / --steps", **names)
    ac_size, ac_batch, ac_seq = full.pick("07", "(AC_SIZE, AC_BATCH, AC_SEQ)", **names)
    assert 16 % plan.nproc == 0, f"16 sequences a step on {plan.nproc} ranks"
    assert seq <= 4096 and ac_size in LM_SIZES
    if plan.device == "cuda":
        assert fits(t, lm_train_memory(size, 16, seq)), "the one process's run holds the whole batch"
        assert fits(t, lm_train_memory(ac_size, ac_batch, ac_seq)), "--ac none, the kernel's largest"
        flops = flops_per_token(LM_SIZES[size], seq) * 16 * seq * steps
        est = 2 * STARTUP_S + flops / (t.tflops_fp32 * 1e12 * STEP_EFFICIENCY) * (1 + 1 / plan.nproc)
        assert full.value("07", "timeout", **names) >= TIMEOUT_MARGIN * est


# --------------------------------------------------------------------------- #
# 08 Ray Tune
# --------------------------------------------------------------------------- #
def test_08_tune(full):
    t = full.target
    trial_cpus = full.value("08", "TRIAL_CPUS")
    trial_gpus = full.value("08", "TRIAL_GPUS")
    slots = trials_per_node(t.cores_per_node, t.gpus_per_node, trial_cpus, trial_gpus)
    samples = full.value("08", "SAMPLES")
    epochs = full.pick("08", "BASE / TrainConfig() / epochs=")
    n_train = full.pick("08", "BASE / TrainConfig() / n_train=")
    n_val = full.pick("08", "BASE / TrainConfig() / n_val=")
    assert slots >= 1 and samples >= slots, "cell 7: the full search keeps every slot busy"
    assert epochs > 2, "ASHA's rungs at 1 and 2 epochs stop trials before the end"
    base = full.value("08", "BASE", TrainConfig=TrainConfig)
    assert n_train // base.batch_size >= 10 and n_val >= base.batch_size
    # cells 3 and 6 assert the searches beat a bad configuration by a margin in held-out accuracy: an accuracy on
    # n images has a standard error of at most 1 / (2 sqrt(n)), which must stay well (3x) under the smallest margin
    margin = min(n.right.value for tree in cells("08") for n in ast.walk(tree)
                 if isinstance(n, ast.BinOp) and ast.unparse(n.left) == "bad_acc")
    for label in ("(bad_loss, bad_acc) / tuning.held_out_score()",
                  "(s['held_out_loss'], s['held_out_acc']) / tuning.held_out_score()",
                  "(_, s['held_out_acc']) / tuning.held_out_score()"):
        assert 3 / (2 * math.sqrt(full.pick("08", label))) <= margin
    population = full.value("08", "POPULATION")
    pbt_epochs = full.pick("08", "pbt_base / TrainConfig() / ** / epochs:")
    # PBT (perturbation_interval=1) replaces the worst quarter after each epoch: a quarter is a trial at least,
    # and the last copy must come before the last epoch
    assert population // 4 >= 1 and pbt_epochs >= 3
    ddp_epochs = full.pick("08", "ddp_base / TrainConfig() / ** / epochs:")
    gpus_each = full.value("08", "gpus_each", GPUS=t.gpus_per_node, workers=full.value("08", "workers"))
    assert ddp_epochs >= 1 and full.value("08", "workers") * gpus_each <= t.gpus_per_node
    # two trials share a GPU (0.5 each): the course's small CNN, twice
    assert fits(t, 2 * train_memory("cnn", base.batch_size))


# --------------------------------------------------------------------------- #
# 09 beyond data parallel
# --------------------------------------------------------------------------- #
def test_09_pipeline(full):
    pp = full.value("09", "PP")
    assert pp.nproc >= 2 and (pp.device == "cpu" or pp.nproc <= full.target.gpus_per_node)
    tree = ast.parse((SCRIPTS / "train_pipeline.py").read_text())
    (default,) = [ast.literal_eval(n.values[1]) for n in ast.walk(tree) if isinstance(n, ast.BoolOp)
                  and ast.unparse(n.values[0]) == "args.microbatches"]
    compute_ms = flag_constant("09", "--compute-ms")
    p = pp.nproc
    assert sum(m >= p for m in default) >= 2, "1F1B needs m >= stages: two counts at least, for its bubble trend"
    # each timed step lasts (m + p - 1) slots of forward + backward (3 x compute), both schedules
    est = STARTUP_S + 2 * sum((m + p - 1) * 3 * compute_ms / 1000 for m in default)
    assert full.pick("09", "pipe_run / run_script(train_pipeline.py) / timeout_s=") >= TIMEOUT_MARGIN * est


def test_09_tensor_parallel(full):
    t = full.target
    tp_plan = full.value("09", "TP")
    assert tp_plan.device == "cpu" or tp_plan.nproc <= t.gpus_per_node
    shape = full.value("09", "TP_SHAPE", TP=tp_plan, TP_CI_SHAPE=full.value("09", "TP_CI_SHAPE"))
    tp_size = flag_constant("09", "--tp-size")
    # section 4's 2-D layout needs a data-parallel dimension on every target: 4 ranks, on the CPU where TP has 2
    two_d = full.value("09", "TP2D", TP=tp_plan)
    assert two_d.nproc >= 2 * tp_size and two_d.nproc % tp_size == 0, two_d
    assert two_d is tp_plan or (two_d.device == "cpu" and tp_plan.nproc == tp_size), (two_d, tp_plan)
    args = script_module("train_tp.py").build_parser().parse_args([str(a) for a in shape])
    # train_tp.py's own condition (it refuses otherwise), and whole attention heads
    ranks = tp_plan.nproc
    assert ranks % tp_size == 0 and args.heads % tp_size == 0 and 4 * args.hidden % tp_size == 0
    assert args.hidden % args.heads == 0 and args.seq % tp_size == 0  # sequence parallelism splits the sequence
    dp = ranks // tp_size
    if tp_plan.device == "cuda":
        # the unsplit blocks on the global batch, fp32: 12 h^2 weights a block (x4 with gradients and momentum),
        # about 16 h activations a token and block, and the attention scores (heads x seq^2 a sequence)
        h, b, s = args.hidden, dp * args.batch, args.seq
        weights = 4 * 4 * 12 * h * h * args.blocks
        acts = 4 * args.blocks * b * s * (16 * h + args.heads * s)
        assert fits(t, 2 * (weights + acts) + CUDA_CONTEXT_BYTES), "the unsplit and the split blocks"
    # the two plans, sequence parallelism, --steps of the 2-D layout and (dp > 1) of FSDP2 on it, each beside the unsplit
    flops = 6 * 12 * args.hidden**2 * args.batch * dp * args.seq * args.blocks * (2 * args.steps + 4)
    est = STARTUP_S + flops / (t.tflops_fp32 * 1e12 * STEP_EFFICIENCY if tp_plan.device == "cuda" else 20e9)
    assert full.pick("09", "tp_run / run_script(train_tp.py) / timeout_s=") >= TIMEOUT_MARGIN * est


def test_09_transformer(full):
    """Section 5's decoder on the pipeline's ranks: 16 sequences cut into 4 micro-batches, the degrees dividing
    the model, the unsplit run within the card, each run within its 300 s."""
    from course_utils.llama import LM_SIZES, flops_per_token
    from course_utils.parallel import ParallelDims

    t, plan = full.target, full.value("09", "PP")
    names = {"PP": plan}
    size, seq = full.pick("09", "LM_ARGS / --lm-size", **names), full.pick("09", "LM_ARGS / --seq-len", **names)
    steps = full.pick("09", "LM_ARGS / --steps", **names)
    layouts = [ParallelDims(tp=2), ParallelDims(pp=2)] + ([ParallelDims(pp=2, tp=2)] if plan.nproc >= 4 else [])
    for dims in layouts:
        assert dims.world_size <= plan.nproc and dims.problems(dims.world_size, LM_SIZES[size], 16, 4) == []
    if plan.device == "cuda":
        assert plan.nproc <= t.gpus_per_node and fits(t, lm_train_memory(size, 16, seq))
        flops = flops_per_token(LM_SIZES[size], seq) * 16 * seq * steps
        assert 300 >= TIMEOUT_MARGIN * (STARTUP_S + flops / (t.tflops_fp32 * 1e12 * STEP_EFFICIENCY))


def test_09_rpc(full):
    steps = full.pick("09", "rpc_run / run_script(rpc_param_server.py) / --steps")
    checked = full.pick("09", "expr / check_param_server() / steps=")
    assert checked == steps, "the cell checks the steps it asked for"
    (timeout,) = call_keywords("09", "run_script('rpc_param_server.py'", "timeout_s")
    # 3 CPU processes whatever the node: 200 steps took 17 s (2.5 s of them training) on the loaded CI machine
    assert timeout >= TIMEOUT_MARGIN * (STARTUP_S + steps * 0.05)


# --------------------------------------------------------------------------- #
# 10 data at scale
# --------------------------------------------------------------------------- #
def test_10_formats(full):
    t = full.target
    n, batch = full.value("10", "N_IMAGES"), full.value("10", "BATCH")
    per_shard = next(k.value.value for tree in cells("10") for node in ast.walk(tree) if isinstance(node, ast.Call)
                     and ast.unparse(node.func) == "write_format" for k in node.keywords if k.arg == "per_shard")
    assert n > per_shard, "several shards: cell 3 counts them"
    steps = full.pick("10", "parts / step_breakdown() / steps=")
    assert steps + 1 <= len(make_loader(range(n), batch, workers=0)), "step_breakdown's untimed step, then `steps`"
    assert fits(t, train_memory("cnn", batch))
    # cell 13: its ranks x 2 workers over the node-local shards, every rank the same samples
    workers = next(node.args[1].value for tree in cells("10") for node in ast.walk(tree)
                   if isinstance(node, ast.Call) and ast.unparse(node.func) == "shards.plan")
    for world in call_keywords("10", "ShardDataset(", "world"):
        spans = reader_spans(n, world, workers, batch)
        assert [sum(b - a for a, b in r) for r in spans] == [n // world] * world
    # section 4b: WebDataset's split_by_node gives rank r of 3 the shards r, r + 3, ...: uneven, as the cell asserts
    sizes = [min(per_shard, n - start) for start in range(0, n, per_shard)]
    dealt = [sum(sizes[r::3]) for r in range(3)]
    assert sum(dealt) == n and len(set(dealt)) > 1, dealt


@pytest.mark.parametrize("target", TARGETS, ids=lambda t: t.name)
@pytest.mark.parametrize("label", ["run / emulate_training() / steps=", "run / emulate_training() / steps= #2"])
def test_10_emulated_steps(target, label, monkeypatch):
    full = Full(target, monkeypatch)
    # the DLIO runs read a stream of the images cycled to 100 batches; each leaves out the first batch and the
    # workers x prefetch_factor (at most 8 x 2 and 2 x 8 in its cells) prepared ahead, then times `steps`
    assert any("Repeated(jpegs, 100 * BATCH)" in ast.unparse(tree) for tree in cells("10"))
    assert 1 + 16 + full.pick("10", label) <= 100, "emulate_training needs 1 + warm-up + steps full batches"


@pytest.mark.parametrize("target", [t for t in TARGETS if t.site], ids=lambda t: t.name)
def test_10_staging_job(target, monkeypatch):
    full = Full(target, monkeypatch)
    n_images = full.value("10", "N_IMAGES")
    n_train = int(full.pick("10", "shard_command / -n / str()", N_IMAGES=n_images))
    n_val = int(full.pick("10", "shard_command / --n-val / str()"))
    flags = full.value("10", "TRAIN_ARGS")
    cfg = config(flags)
    _, ranks, _ = per_node(target.site, "multi_node_srun")
    world = ranks * int(site_script(target.site, "multi_node_srun")[1]["--nodes"])
    # the shard command picks the size; any size is dealt to world x workers readers in whole steps
    spans = reader_spans(n_train, world, cfg.workers, cfg.batch_size)
    assert [sum(b - a for a, b in r) for r in spans] == [n_train // world] * world
    assert n_train // world >= cfg.batch_size, "every rank at least one whole batch"
    limit_s = 3600 * hours(slurm.TIME_LIMIT)
    est = job_seconds(target, flags, "multi_node_srun", n_train=n_train) + n_val / LOADER_IMAGES_PER_S
    assert limit_s >= TIMEOUT_MARGIN * est
    assert full.pick("10", "rec / slurm.wait() / timeout_s=") >= limit_s


# --------------------------------------------------------------------------- #
# 11 when things go wrong
# --------------------------------------------------------------------------- #
def test_11_hang(full):
    """Every fault runs on the CPU with gloo, whatever the node: the full profile only waits longer for the stuck
    rank (a loaded login or portal node starts processes slowly), and each run still ends inside its 120 s limit:
    start-up, the timeout (twice TIMEOUT_S for section 1's hang, which is looked at while it lasts), then the
    launcher's stop."""
    timeout_s = full.value("11", "TIMEOUT_S")
    assert 5 <= timeout_s and 2 * timeout_s <= 120 / 2


def test_11_memory(full):
    """Section 6 trains resnet18 with AdamW at the full profile's batch on one GPU, then again with the allocator
    capped between step 1's peak and step 2's: both fit the card with the course's margin."""
    assert fits(full.target, train_memory("resnet18", full.value("11", "BATCH"), "adamw"))


# --------------------------------------------------------------------------- #
# 12 long sequences and experts
# --------------------------------------------------------------------------- #
def test_12_long_sequences_and_experts(full):
    """The decoder on the plan's ranks: its sequence split zig-zag over all of them (and over 2 beside FSDP2 on 4),
    8 sequences a step dealt evenly, 4 experts spread over the ranks, the unsplit run within the card and each run
    within its 300 s; the longer sequences of sections 2 and 3 split as the runs split them, each rank's share within
    the card and the run within its 300 s; the text for the router within what the standard library holds."""
    from course_utils.llama import LM_SIZES, build_llama, flops_per_token
    from course_utils.parallel import ParallelDims

    t, plan = full.target, full.value("12", "PLAN")
    names = {"DEVICE": plan.device}
    size, seq = full.pick("12", "LM_ARGS / --lm-size", **names), full.pick("12", "LM_ARGS / --seq-len", **names)
    steps = full.pick("12", "LM_ARGS / --steps", **names)
    n = plan.nproc
    moe = build_llama(size, experts=4).shape
    layouts = [(ParallelDims(cp=n), 8), (ParallelDims(dp_shard=n, ep=n), 8 // n)]
    layouts += [(ParallelDims(cp=2, dp_shard=2), 4)] if n >= 4 else []
    for dims, batch in layouts:
        assert dims.problems(n if dims.world_size == n else 4, moe, batch, 1, seq) == [], dims
        assert batch * dims.dp == 8
    assert full.pick("12", "TEXT_BYTES") <= 4_000_000  # load_tokens' default cap: the stdlib holds more
    # section 2's split measured at 8 x the sequence (4 sequences, all ranks); section 3's activations at 1, 2 and 4 x
    # it, one step of 8 sequences, on 1 rank and on each CP degree (a run of that many ranks)
    long_runs = [(n, 4, 8 * seq, 2)] + [(cp, 8, k * seq, 1) for cp in ([1, 2, 4] if n >= 4 else [1, 2]) for k in (1, 2, 4)]
    for cp, batch, length, _ in long_runs:
        assert ParallelDims(cp=cp).problems(cp, moe, batch, 1, length) == [], (cp, length)
    if plan.device == "cuda":
        assert n <= t.gpus_per_node and fits(t, lm_train_memory(size, 8, seq))
        flops = flops_per_token(LM_SIZES[size], seq) * 8 * seq * steps
        assert 300 >= TIMEOUT_MARGIN * (STARTUP_S + flops / (t.tflops_fp32 * 1e12 * STEP_EFFICIENCY))
        heads = LM_SIZES[size].heads
        for cp, batch, length, run_steps in long_runs:
            assert cp <= t.gpus_per_node, f"a CP {cp} run needs {cp} GPUs"
            # each rank's share of the tokens, the whole weights and AdamW state, and the ring's one chunk pair at a
            # time (fp32 scores, probabilities, and in backward their gradients: 4 of them); SDPA on one rank holds none
            ring = 0 if cp == 1 else 4 * 4 * batch * heads * (length // (2 * cp)) ** 2
            assert fits(t, lm_train_memory(size, batch, length // cp) + ring), (cp, length)
            flops = flops_per_token(LM_SIZES[size], length) * batch * length * run_steps / cp
            assert 300 >= TIMEOUT_MARGIN * (STARTUP_S + flops / (t.tflops_fp32 * 1e12 * STEP_EFFICIENCY)), (cp, length)
