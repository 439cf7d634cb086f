"""What this node has: CPU, memory, GPUs and what they can do, library versions,
``torch.backends`` switches and the distributed backends that are built in."""

from __future__ import annotations

import os
import platform
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from .paths import child_env
from .precision import BF16_MIN_CAPABILITY, cpu_bf16_here
from .precision import tf32 as tf32_switch
from .precision import tf32_state


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    except (ValueError, OSError, AttributeError):
        return float("nan")


def usable_cores() -> int:
    """Cores this process may run on (Slurm's cgroup, taskset), not the node's total."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS
        return os.cpu_count() or 1


def threads_per_rank(ranks: int) -> int:
    """The usable cores shared evenly by ``ranks`` processes on this host (at least one each)."""
    return max(1, usable_cores() // max(1, ranks))


def gpu_report() -> list[dict[str, Any]]:
    """One entry per visible GPU: name, memory, compute capability, bf16/TF32."""
    gpus = []
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        major, minor = p.major, p.minor
        gpus.append(
            {
                "index": i,
                "name": p.name,
                "memory_gib": round(p.total_memory / 2**30, 1),
                "compute_capability": f"{major}.{minor}",
                "multiprocessors": p.multi_processor_count,
                # tensor cores: fp16 from Volta (7.0); TF32 and bf16 from Ampere (8.0)
                "tf32": major >= 8,
                "bf16": major >= 8,
                "fp16_tensor_cores": major >= 7,
            }
        )
    return gpus


def cuda_facts() -> dict[str, Any]:
    """Whether torch can use CUDA, :func:`gpu_report`, and the cuDNN and NCCL versions, read here
    (this starts CUDA in this process)."""
    cuda = torch.cuda.is_available()
    facts: dict[str, Any] = {"cuda_available": cuda, "gpus": gpu_report() if cuda else [],
                             "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                             "nccl": None}
    if cuda and dist.is_available() and dist.is_nccl_available():
        try:
            version = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
        except Exception:
            pass
    return facts


def _cuda_facts_fork_safe() -> dict[str, Any]:
    """:func:`cuda_facts` without starting CUDA in this process.

    A notebook kernel that has started CUDA cannot fork ranks (``ddp_notebook``,
    ``multiprocessing`` with fork): their first CUDA call fails. So unless this
    process has started CUDA already, the facts come from a short-lived Python
    of its own. ``torch.cuda.device_count()`` asks NVML first and does not
    start CUDA; with no GPU there is nothing to ask.
    """
    if torch.cuda.is_initialized() or torch.cuda.device_count() == 0:
        return cuda_facts()
    import json
    import subprocess
    import sys

    code = "import json; from course_utils.hardware import cuda_facts; print(json.dumps(cuda_facts()))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(), timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"reading the GPUs in a subprocess failed: {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def environment_report() -> dict[str, Any]:
    """Everything notebook 00 shows, as a dictionary (also handy in job logs).

    Safe in a notebook kernel that forks ranks later: it does not start CUDA here (:func:`_cuda_facts_fork_safe`).
    """
    facts = _cuda_facts_fork_safe()
    report: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": _cpu_model(),
        "cpu_bf16": cpu_bf16_here(),  # bf16 instructions: amp trains in bf16 on this CPU, else fp32
        "cores_total": os.cpu_count(),
        "cores_usable": usable_cores(),
        "memory_gib": round(_memory_gib(), 1),
        "torch": torch.__version__,
        "cuda_available": facts["cuda_available"],
        "cuda_runtime": torch.version.cuda,
        "cudnn": facts["cudnn"],
        "nccl": facts["nccl"],
        "gpus": facts["gpus"],
        "backends": {
            "gloo": dist.is_available() and dist.is_gloo_available(),
            "nccl": dist.is_available() and dist.is_nccl_available(),
            "mpi": dist.is_available() and dist.is_mpi_available(),
        },
        "flags": {
            "cudnn.enabled": torch.backends.cudnn.enabled,
            "cudnn.benchmark": torch.backends.cudnn.benchmark,
            "tf32 in convolutions": tf32_state()["conv"],
            "tf32 in fp32 matmuls": tf32_state()["matmul"],
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "mkldnn": torch.backends.mkldnn.is_available(),
            "openmp": torch.backends.openmp.is_available(),
            "torch_threads": torch.get_num_threads(),
        },
        "slurm_job": os.environ.get("SLURM_JOB_ID"),
    }
    try:
        import torchvision

        report["torchvision"] = torchvision.__version__
    except Exception as exc:  # a broken torchvision should not hide the rest of the report
        report["torchvision"] = f"unavailable ({type(exc).__name__}: {exc})"
    return report


def hardware_label(report: dict[str, Any], device_type: str, ranks: int = 1, backend: str | None = None) -> str:
    """The label every measured number carries: what ran it, e.g. ``2 x NVIDIA H100 80GB HBM3, nccl``."""
    if device_type == "cuda":
        what = f"{ranks} x {report['gpus'][0]['name']}" if ranks > 1 else report["gpus"][0]["name"]
    else:
        what = f"CPU {report['cpu']} ({report['cores_usable']} cores)"
    return f"{what}, {backend}" if backend else what


def peak_memory_mib(device: torch.device | str) -> float:
    """The peak memory this process used: the CUDA allocator's peak on a GPU, the peak resident set on a CPU."""
    device = torch.device(device)
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def print_report(report: dict[str, Any] | None = None) -> dict[str, Any]:
    """Print :func:`environment_report` as a readable block; return it."""
    r = report or environment_report()
    print(f"host            {r['host']}  ({r['platform']})")
    print(f"cpu             {r['cpu']}")
    print(f"cores           {r['cores_usable']} usable of {r['cores_total']}")
    print(f"memory          {r['memory_gib']} GiB")
    print(f"python / torch  {r['python']} / {r['torch']}   torchvision {r['torchvision']}")
    print(f"cuda / cudnn    {r['cuda_runtime']} / {r['cudnn']}   nccl {r['nccl']}")
    if r["gpus"]:
        for g in r["gpus"]:
            print(
                f"gpu {g['index']}           {g['name']}, {g['memory_gib']} GiB, "
                f"cc {g['compute_capability']}, {g['multiprocessors']} SMs, "
                f"bf16={'yes' if g['bf16'] else 'no'} tf32={'yes' if g['tf32'] else 'no'}"
            )
    else:
        print("gpu             none visible: the course runs on the CPU with the gloo backend")
    built = [name for name, ok in r["backends"].items() if ok]
    print(f"dist backends   {', '.join(built) or 'none'}")
    for key, value in r["flags"].items():
        print(f"  {key:26s}{value}")
    if r["slurm_job"]:
        print(f"slurm job       {r['slurm_job']}")
    return r


def matmul_tflops(dtype: torch.dtype, n: int = 4096, device: str | torch.device = "cpu",
                  repeats: int = 10, tf32: bool = False) -> float:
    """Measured dense matmul throughput in TFLOP/s (2*n^3 flops per product), from the fastest of
    ``repeats`` products: a peak, which a busy moment on a shared node slows only for some products
    (notebook 01 holds a training step below it).

    ``tf32=True`` with ``float32`` lets Ampere+ tensor cores do the fp32 matmul.
    """
    device = torch.device(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda _device: None)
    with tf32_switch(tf32):
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        for _ in range(2):  # warm-up: library loading, kernel selection
            a @ b
        sync(device)
        fastest = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            sync(device)  # a CUDA product is queued: its time is until the GPU has finished it
            fastest = min(fastest, time.perf_counter() - start)
    return 2 * n**3 / fastest / 1e12


def tensor_core_peak_tflops(device: str | torch.device) -> float | None:
    """A GPU's measured matmul rate in its fastest half format, the peak MFU is taken against: bf16 from Ampere
    (8.0) on; before it (Turing: Frontera's RTX 5000) bf16 is emulated and slow, so fp16's. None on a CPU,
    where no tensor-core peak stands for what the hardware can do."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    half = torch.bfloat16 if torch.cuda.get_device_capability(device) >= BF16_MIN_CAPABILITY else torch.float16
    return matmul_tflops(half, device=device)


def matmul_table(device: str | torch.device = "cpu", n: int = 4096, repeats: int = 10) -> list[dict[str, Any]]:
    """TFLOP/s for each number format this device does: the tensor-core lesson in numbers."""
    device = torch.device(device)
    formats: list[tuple[str, torch.dtype, bool]] = [("fp32", torch.float32, False)]
    if device.type == "cuda":
        major, _ = torch.cuda.get_device_capability(device)
        if major >= 8:
            formats += [("tf32", torch.float32, True), ("bf16", torch.bfloat16, False)]
        formats += [("fp16", torch.float16, False)]
    else:
        formats += [("bf16", torch.bfloat16, False)]
    rows = []
    for name, dtype, tf32 in formats:
        rows.append({"format": name, "tflops": matmul_tflops(dtype, n, device, repeats, tf32)})
    base = rows[0]["tflops"]
    for row in rows:
        row["vs_fp32"] = row["tflops"] / base
    return rows
