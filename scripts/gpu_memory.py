"""The peak GPU memory a notebook's processes use, from NVML, without starting CUDA in gpu-check's own process."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Sequence
from typing import Any


def nvml_indices(cuda_uuids: Sequence[str], nvml_uuids: Sequence[str]) -> list[int] | None:
    """Where each GPU this job's CUDA sees is in NVML's list (``nvml_uuids``, NVML's index order), by UUID.

    Not from CUDA_VISIBLE_DEVICES: its numbers are CUDA's, and Slurm's cgroups renumber them (a job
    told "2,3" whose NVML sees its two GPUs as 0 and 1, or told "0,1" on a node whose NVML sees all
    four), and CUDA's order need not be NVML's (CUDA_DEVICE_ORDER). torch writes a UUID bare, NVML
    with "GPU-" before it. None where one has no match (a MIG slice has a UUID of its own): no
    peak is better than another job's GPU.
    """
    def key(uuid: str) -> str:
        uuid = str(uuid).strip().lower()
        return uuid.split("-", 1)[1] if uuid.startswith(("gpu-", "mig-")) else uuid

    where = {key(u): i for i, u in enumerate(nvml_uuids)}
    found = [where.get(key(u)) for u in cuda_uuids]
    return None if not found or None in found else found


class GpuMemorySampler:
    """The peak memory used on this job's GPUs (MiB, summed over GPUs) while a block runs, from NVML.

    NVML sees every process's memory, the ranks a notebook forks or launches included, without
    starting CUDA here. ``gpu_uuids`` are the GPUs CUDA sees (:func:`cuda_uuids`), found in NVML by
    UUID (:func:`nvml_indices`). Where NVML is missing (no NVIDIA driver, no nvidia-ml-py) or a GPU
    is not found in it, ``peak_mib`` is ``None``.
    """

    def __init__(self, gpu_uuids: Sequence[str] = (), interval_s: float = 0.2) -> None:
        self.interval_s, self.peak_mib, self._stop = interval_s, None, threading.Event()
        self._handles: list[Any] = []
        self._nvml = None
        if not gpu_uuids:
            return
        try:
            import pynvml

            pynvml.nvmlInit()
            handles, uuids = [], []
            for i in range(pynvml.nvmlDeviceGetCount()):
                try:  # NVML may list GPUs of the node that this job's cgroup does not let it open
                    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
                    uuid = pynvml.nvmlDeviceGetUUID(handle)
                except pynvml.NVMLError:
                    continue
                handles.append(handle)
                uuids.append(uuid.decode() if isinstance(uuid, bytes) else uuid)  # bytes from older bindings
        except Exception:
            return
        indices = nvml_indices(gpu_uuids, uuids)
        if indices is not None:
            self._nvml, self._handles = pynvml, [handles[i] for i in indices]

    def _used_mib(self) -> float:
        return sum(self._nvml.nvmlDeviceGetMemoryInfo(h).used for h in self._handles) / 2**20

    def __enter__(self) -> GpuMemorySampler:
        if self._nvml and self._handles:
            self._base, self.peak_mib = self._used_mib(), 0.0
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.peak_mib = max(self.peak_mib, self._used_mib() - self._base)

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self.peak_mib is not None:
            self._thread.join()


def cuda_uuids() -> list[str]:
    """The UUIDs of the GPUs CUDA sees, in CUDA's order, read in a child process (this one starts CUDA
    only at the end); [] where that fails (the report's peaks are then n/a)."""
    from course_utils.paths import child_env

    code = ("import torch; n = torch.cuda.device_count(); "
            "print(' '.join(str(torch.cuda.get_device_properties(i).uuid) for i in range(n)))")
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=child_env(),
                             timeout=120)
    except subprocess.TimeoutExpired:
        return []
    return out.stdout.split() if out.returncode == 0 else []


