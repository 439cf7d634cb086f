"""Number formats a training step may run in, and what this device can do.

``fp32`` everywhere (with TF32 tensor cores inside matmuls and convolutions
when switched on), or autocast to ``bf16`` or ``fp16`` (with a GradScaler);
``amp`` picks the better of the two for the device.

What a GPU can do is decided from its compute capability, a fact of the
hardware: bf16 and TF32 tensor cores from Ampere (8.0) on. What a CPU can do,
from its instruction set (``/proc/cpuinfo``): ``amp`` is bf16 only where the
processor has bf16 instructions (x86's AVX-512 BF16 or AMX, Arm's BF16). Elsewhere
bf16 is emulated, and an autocast convolution or matmul runs several times (up
to 80x, measured on a 2-core AVX2 EPYC) slower than in fp32. Not from
``torch.cuda.is_bf16_supported()``, which by default also counts bf16 that
is only *emulated* (it says yes on Frontera's Turing RTX 5000, where cuDNN has
no bf16 convolutions) and allocates a tensor on the current GPU to find out,
so a rank that calls it before ``set_device`` opens a context on GPU 0.

Reproducible arithmetic is switched here too (:func:`deterministic_env`,
:func:`determinism_for`): every trainer of the course passes through
:func:`resolve_precision` before its first step, so one environment variable
makes a launched run (train.py, the loop by hand, Lightning, Fabric, the DeepSpeed
and FSDP scripts) compute the same bits every time.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping

import torch

PRECISIONS = ("fp32", "bf16", "fp16", "amp")
BF16_MIN_CAPABILITY = (8, 0)  # Ampere: bf16 and TF32 tensor cores
CPU_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 (flags line), Arm (Features line)


def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of this machine's CPU (``/proc/cpuinfo``: ``flags`` on x86, ``Features`` on
    Arm); empty where there is no such file (macOS)."""
    if cpuinfo is None:
        try:
            with open("/proc/cpuinfo") as f:
                cpuinfo = f.read()
        except OSError:
            return frozenset()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(value.split())
    return frozenset()


def cpu_has_bf16(flags: frozenset[str] | set[str]) -> bool:
    """Whether a CPU with these flags computes bf16 in hardware (else it is emulated, several times slower)."""
    return any(flag in flags for flag in CPU_BF16_FLAGS)


def cpu_bf16_here() -> bool:
    """Whether this machine's CPU computes bf16 in hardware (:func:`cpu_flags`, :func:`cpu_has_bf16`)."""
    return cpu_has_bf16(cpu_flags())


def precision_for(precision: str, device_type: str, capability: tuple[int, int] | None = None,
                  gpu_name: str = "this GPU", cpu_bf16: bool = False) -> str:
    """The precision a run uses, from the hardware facts alone (tested without a GPU).

    ``amp`` becomes ``bf16`` where the GPU has bf16 tensor cores (compute capability >= 8.0)
    and ``fp16`` (with a GradScaler) before that; on a CPU it becomes ``bf16`` where the CPU has
    bf16 instructions (``cpu_bf16``, :func:`cpu_has_bf16`) and ``fp32`` where it does not. ``bf16``
    asked for by name runs on any CPU, emulated where it must be. A format the device cannot run
    is refused with what to use instead.
    """
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of: {', '.join(PRECISIONS)}")
    if device_type == "cuda":
        if capability is None:
            raise ValueError("a GPU's precision needs its compute capability")
        bf16_ok = tuple(capability) >= BF16_MIN_CAPABILITY
        if precision == "amp":
            return "bf16" if bf16_ok else "fp16"
        if precision == "bf16" and not bf16_ok:
            raise ValueError(
                f"{gpu_name} (compute capability {capability[0]}.{capability[1]}) has no bf16 tensor cores "
                "(they came with Ampere, 8.0; Frontera's RTX 5000 is Turing, 7.5): use --precision fp16 or amp."
            )
        return precision
    if precision == "amp":  # fp16 on a CPU is rarely faster, and emulated bf16 is much slower than fp32
        return "bf16" if cpu_bf16 else "fp32"
    if precision == "fp16":
        raise ValueError("fp16 with a GradScaler is a GPU technique; on CPU use bf16 or fp32.")
    return precision


def resolve_precision(precision: str, device: torch.device | str) -> str:
    """Turn ``amp`` into ``bf16`` or ``fp16`` for ``device``; reject what it cannot do.

    Reads only the device's properties (no allocation, no context on another rank's GPU).
    Also switches this process to deterministic kernels where its environment asks for them
    (``COURSE_DETERMINISTIC=1``, see :func:`deterministic_env`): every trainer calls this before its first step.
    """
    device = torch.device(device)
    apply_determinism(device.type)
    if device.type != "cuda":
        return precision_for(precision, device.type, cpu_bf16=cpu_bf16_here())
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    return precision_for(precision, "cuda", (props.major, props.minor), props.name)


def _new_tf32_api() -> bool:
    """``fp32_precision`` (torch >= 2.9) replaces ``allow_tf32``; mixing the two makes torch raise on reads."""
    return hasattr(torch.backends.cuda.matmul, "fp32_precision") and hasattr(torch.backends.cudnn, "conv")


def _set_matmul_tf32(value: bool | str) -> None:
    """TF32 in fp32 matmuls on or off (or a value read by :func:`_matmul_tf32`), through
    ``torch.set_float32_matmul_precision``: "high" sets the new API's matmul switches to tf32 and keeps
    ``torch.get_float32_matmul_precision()`` readable. Lightning reads it on every Ampere or later GPU; after
    ``cuda.matmul.fp32_precision = "tf32"`` set directly, torch 2.11 to 2.14 raise there (a mix of APIs)."""
    torch.set_float32_matmul_precision(value if isinstance(value, str) else ("high" if value else "highest"))


def _matmul_tf32() -> str:
    """The matmul switch as set, for :func:`_set_matmul_tf32` to put back."""
    return torch.get_float32_matmul_precision()


def set_tf32(enabled: bool | None) -> None:
    """TF32 tensor-core math for fp32 matmuls and convolutions (Ampere and later).

    A process-wide switch: 10 mantissa bits instead of 23 inside the matmul,
    fp32 everywhere else. ``None`` restores PyTorch's defaults (convolutions
    may use TF32, matmuls do not), which is what a textbook loop runs with.
    It has no effect on CPUs or pre-Ampere GPUs. Matmuls through
    ``torch.set_float32_matmul_precision``; convolutions through ``cudnn.conv.fp32_precision``
    where torch has it, ``allow_tf32`` (deprecated in 2.9) where it does not.
    """
    conv = True if enabled is None else bool(enabled)
    _set_matmul_tf32(bool(enabled))
    if _new_tf32_api():
        torch.backends.cudnn.conv.fp32_precision = "tf32" if conv else "ieee"
    else:  # pragma: no cover - torch < 2.9
        torch.backends.cudnn.allow_tf32 = conv


def set_math_switches(tf32: bool | None, cudnn_benchmark: bool) -> None:
    """The process-wide math switches a run's settings choose, set in one place: TF32 (:func:`set_tf32`) and
    cuDNN's algorithm search (``cudnn.benchmark``: it times the convolution algorithms for each new input shape
    and keeps the fastest; not deterministic, which is why :func:`apply_determinism` turns it off). A process
    holds one value of each: every Trainer built sets both to its own settings (notebook 01's ladder builds
    one per rung). Lightning sets ``cudnn.benchmark`` itself, from its ``benchmark`` flag (``lit.make_trainer``)."""
    set_tf32(tf32)
    torch.backends.cudnn.benchmark = cudnn_benchmark


def tf32_state() -> dict[str, bool]:
    """Whether fp32 matmuls and convolutions may use TF32 now (read with the API :func:`set_tf32` writes)."""
    matmul = _matmul_tf32() != "highest"
    conv = torch.backends.cudnn.conv.fp32_precision in ("tf32", "none") if _new_tf32_api() \
        else torch.backends.cudnn.allow_tf32  # pragma: no cover - torch < 2.9
    return {"matmul": matmul, "conv": conv}


@contextlib.contextmanager
def tf32(enabled: bool):
    """TF32 for fp32 matmuls inside the block only (the matmul benchmark's switch)."""
    previous = _matmul_tf32()
    _set_matmul_tf32(enabled)
    try:
        yield
    finally:
        _set_matmul_tf32(previous)


def autocast(precision: str, device: torch.device) -> contextlib.AbstractContextManager:
    """The forward pass's context for a resolved ``precision`` (see :func:`resolve_precision`)."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


# --------------------------------------------------------------------------- #
# Deterministic kernels: the same bits from every run
# --------------------------------------------------------------------------- #
DETERMINISTIC_VAR = "COURSE_DETERMINISTIC"
CUBLAS_VAR = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")  # the two values torch's check accepts (at::Context, CUDA >= 10.2)


def deterministic_env() -> dict[str, str]:
    """The environment of a launched run that must compute the same bits every time:
    ``run_script(..., env=deterministic_env())``. Only that process and its children see it; the
    notebook kernel's environment is left alone.

    ``COURSE_DETERMINISTIC=1`` is read by :func:`resolve_precision` in the run (:func:`determinism_for`).
    ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` gives cuBLAS a fixed workspace per stream, without which a
    matmul may split its sums differently from run to run (CUDA >= 10.2); torch reads it when it
    makes its first cuBLAS workspace, so it belongs in the environment the process starts with.
    """
    return {DETERMINISTIC_VAR: "1", CUBLAS_VAR: CUBLAS_DETERMINISTIC[0]}


def determinism_for(env: Mapping[str, str], device_type: str) -> dict[str, bool] | None:
    """What a process with environment ``env``, computing on ``device_type``, switches: a pure function
    (tested without a GPU). ``None``: nothing asked, torch's defaults stay (fast, not reproducible on GPUs).

    Asked for (``COURSE_DETERMINISTIC=1``): ``torch.use_deterministic_algorithms(True)`` (an operation with
    only a non-deterministic CUDA kernel raises instead of running; the convolutions pick deterministic
    cuDNN algorithms), ``cudnn.deterministic`` (the same, for cuDNN alone) and ``cudnn.benchmark`` off
    (timing algorithms may choose another one in each run). On CUDA, ``CUBLAS_WORKSPACE_CONFIG`` must be one of
    :data:`CUBLAS_DETERMINISTIC`: without it the first matmul would raise, after the data and model were built.
    """
    asked = env.get(DETERMINISTIC_VAR, "").strip().lower()
    if asked in ("", "0", "false", "no"):
        return None
    if asked not in ("1", "true", "yes"):
        raise ValueError(f"{DETERMINISTIC_VAR}={env[DETERMINISTIC_VAR]!r}: use 1 (deterministic kernels) or 0")
    if device_type == "cuda" and env.get(CUBLAS_VAR) not in CUBLAS_DETERMINISTIC:
        raise ValueError(
            f"{DETERMINISTIC_VAR}=1 on a GPU needs {CUBLAS_VAR}={CUBLAS_DETERMINISTIC[0]} in the environment the "
            f"process starts with (it has {env.get(CUBLAS_VAR, 'none')!r}): launch it with "
            "env=course_utils.precision.deterministic_env()")
    return {"use_deterministic_algorithms": True, "cudnn_deterministic": True, "cudnn_benchmark": False}


def apply_determinism(device_type: str, env: Mapping[str, str] | None = None) -> bool:
    """Switch this process to deterministic kernels if its environment asks (:func:`determinism_for`).

    True when switched. A later ``cudnn.benchmark = True`` (``--cudnn-benchmark``) would undo the last part.
    """
    switches = determinism_for(os.environ if env is None else env, device_type)
    if switches is None:
        return False
    torch.use_deterministic_algorithms(switches["use_deterministic_algorithms"])
    torch.backends.cudnn.deterministic = switches["cudnn_deterministic"]
    torch.backends.cudnn.benchmark = switches["cudnn_benchmark"]
    return True


def deterministic_state() -> dict[str, bool]:
    """The switches as torch has them now (what a run can report, and a test can check)."""
    return {"use_deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "cudnn_deterministic": bool(torch.backends.cudnn.deterministic),
            "cudnn_benchmark": bool(torch.backends.cudnn.benchmark)}
