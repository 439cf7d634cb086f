"""Which device each rank drives, and which backend the group uses: one policy.

The rule NCCL imposes: **never two ranks on one GPU** (it refuses with
"Duplicate GPU detected"). So, per host, ranks never exceed GPUs. A 1-GPU
portal session asked for a 4-rank demo cannot run it on the GPU; it either
runs fewer ranks (one per GPU) or runs the demo on the CPU with gloo, and
says which.

Two pure functions hold the policy, so it is tested without a GPU:

* :func:`place_ranks` -- for a running job: given what every rank sees (its
  host and the GPUs visible to it), the device and backend of each rank, or
  one :class:`PlacementError` that says what to change. Every rank gets the
  same answer, because rank 0 computes it during the rendezvous
  (``course_utils.process_group``) and hands it to the others.
* :func:`plan_demo` -- before launching: how many ranks a notebook demo should
  start on this host and on which device.

Which GPUs a rank sees depends on the launcher: ``torchrun`` shows every rank
all of the node's GPUs (rank k takes the k-th); ``srun --gpus-per-task=1`` or
``--gpu-bind`` shows each task only its own GPU (so every task's only GPU is
``cuda:0``, and they are different GPUs). Comparing GPU UUIDs, not indices,
covers both (a MIG slice: its GPU's PCI address, :func:`gpu_ids`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

DEVICE_CHOICES = ("auto", "cpu", "cuda")


class PlacementError(RuntimeError):
    """The ranks cannot be placed as asked; the message says what to change."""


@dataclass(frozen=True)
class RankView:
    """What one rank sees: its host, and the GPUs visible to it in index order (UUIDs, :func:`gpu_ids`)."""

    host: str
    gpus: tuple[str, ...] = ()


@dataclass(frozen=True)
class Placement:
    device: str  # "cpu" or "cuda:N" (N indexes this rank's visible GPUs)
    backend: str  # "nccl" or "gloo"
    note: str = ""  # one line when the placement differs from what was asked


def _check_requested(requested: str) -> str:
    requested = requested.lower()
    if requested not in DEVICE_CHOICES and not (requested.startswith("cuda:") and requested[5:].isdigit()):
        raise ValueError(f"unknown device {requested!r}: use auto, cpu, cuda or cuda:N")
    return requested


def place_ranks(views: Sequence[RankView], requested: str = "auto", nccl_available: bool = True) -> list[Placement]:
    """The device and backend of every rank (index = global rank).

    ``requested``: ``auto`` (a GPU each when every host has enough, else
    the CPU with gloo, said in the note), ``cpu``, ``cuda`` (a GPU each, or an
    error saying why not) or ``cuda:N`` (that GPU; two ranks on one GPU are
    still an error with NCCL).
    """
    requested = _check_requested(requested)
    world = len(views)
    if world == 0:
        raise ValueError("place_ranks needs at least one rank")
    if requested == "cpu":
        return [Placement("cpu", "gloo")] * world

    no_gpu = [r for r, v in enumerate(views) if not v.gpus]
    if no_gpu:
        where = sorted({views[r].host for r in no_gpu})
        if requested != "auto":
            raise PlacementError(
                f"--device {requested} was asked for, but no CUDA GPU is visible to rank(s) "
                f"{_ranks(no_gpu)} on {', '.join(where)}. Run on a GPU node (and ask Slurm for GPUs: "
                "--gres=gpu:N or --gpus-per-node=N), or use --device cpu."
            )
        # a note only where some rank does see a GPU: on a CPU machine gloo is what was expected
        note = "" if len(no_gpu) == world else \
            f"rank(s) {_ranks(no_gpu)} see no GPU: all ranks run on the CPU with gloo"
        return [Placement("cpu", "gloo", note)] * world

    devices, crowded = _assign_gpus(views, requested)
    shared = _shared_gpus(views, devices)
    if crowded or (shared and nccl_available):
        if crowded:
            (host, gpus), n = next(iter(crowded.items()))
            problem = f"{n} ranks on {host} but only {len(gpus)} GPU(s) there"
        else:
            a, b, host = shared[0]
            problem = f"ranks {a} and {b} would share one GPU on {host}"
        fix = ("start at most one rank per GPU on each host (torchrun --nproc-per-node=<GPUs>, "
               "srun --ntasks-per-node=<GPUs>), or use --device cpu to run the ranks on the CPU with gloo")
        if requested == "auto":
            return [Placement("cpu", "gloo", f"{problem}: NCCL cannot put two ranks on one GPU, "
                                             "so all ranks run on the CPU with gloo")] * world
        raise PlacementError(f"{problem}, and NCCL refuses two ranks on one GPU: {fix}.")

    backend = "nccl" if nccl_available else "gloo"
    return [Placement(d, backend) for d in devices]


def _assign_gpus(views: Sequence[RankView], requested: str) -> tuple[list[str], dict[tuple[str, tuple[str, ...]], int]]:
    """Each rank's GPU ("" where there is none left), and the views with more ranks than GPUs.

    Ranks that see the same GPUs on the same host share them: the k-th of them takes the k-th GPU.
    """
    devices: list[str] = []
    crowded: dict[tuple[str, tuple[str, ...]], int] = {}
    seen: dict[tuple[str, tuple[str, ...]], int] = {}
    for v in views:
        key = (v.host, v.gpus)
        k = seen.get(key, 0)
        seen[key] = k + 1
        if requested.startswith("cuda:"):
            index = int(requested[5:])
            if index >= len(v.gpus):
                raise PlacementError(f"--device {requested} asked for, but {v.host} shows this rank only "
                                     f"{len(v.gpus)} GPU(s) (cuda:0 to cuda:{len(v.gpus) - 1}).")
            devices.append(requested)
        elif k < len(v.gpus):
            devices.append(f"cuda:{k}")
        else:
            devices.append("")
            crowded[key] = seen[key]
    return devices, crowded


def _shared_gpus(views: Sequence[RankView], devices: Sequence[str]) -> list[tuple[int, int, str]]:
    """``(first rank, second rank, host)`` for each GPU two ranks reach through different views
    (``cuda:N`` everywhere, or two torchrun agents on one host), by the GPUs' UUIDs."""
    owner: dict[tuple[str, str], int] = {}
    shared: list[tuple[int, int, str]] = []
    for r, (v, d) in enumerate(zip(views, devices)):
        if d:
            key = (v.host, v.gpus[int(d[5:])])
            if key in owner:
                shared.append((owner[key], r, v.host))
            else:
                owner[key] = r
    return shared


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(map(str, ranks[:16])) + (" ..." if len(ranks) > 16 else "")


@dataclass(frozen=True)
class DemoPlan:
    """How a notebook runs an N-rank demo on this host."""

    nproc: int
    device: str  # "cuda" or "cpu": pass as --device to the script
    backend: str
    note: str = ""  # one line when this differs from what was asked

    @property
    def label(self) -> str:
        return f"{self.nproc} rank(s), {self.backend} on {'GPUs' if self.device == 'cuda' else 'CPU'}"


def plan_demo(wanted: int, gpus: int, minimum: int = 1, fallback: str = "cpu",
              nccl_available: bool = True) -> DemoPlan:
    """Ranks and device for a demo that asks for ``wanted`` ranks on a host with ``gpus`` GPUs.

    With enough GPUs: one rank per GPU, NCCL. With fewer: ``fallback="cap"``
    runs as many ranks as there are GPUs (when that is still ``>= minimum``),
    ``fallback="cpu"`` keeps ``wanted`` ranks on the CPU with gloo. The note
    says which, in one line.
    """
    if wanted < 1 or minimum < 1 or minimum > wanted:
        raise ValueError(f"need 1 <= minimum <= wanted, got minimum={minimum}, wanted={wanted}")
    if fallback not in ("cpu", "cap"):
        raise ValueError(f"fallback must be 'cpu' or 'cap', not {fallback!r}")
    if gpus <= 0:
        return DemoPlan(wanted, "cpu", "gloo")
    backend = "nccl" if nccl_available else "gloo"
    if gpus >= wanted:
        return DemoPlan(wanted, "cuda", backend)
    if fallback == "cap" and gpus >= minimum:
        return DemoPlan(gpus, "cuda", backend,
                        f"asked for {wanted} ranks, this host has {gpus} GPU(s): running {gpus} (one per GPU)")
    return DemoPlan(wanted, "cpu", "gloo",
                    f"asked for {wanted} ranks, this host has {gpus} GPU(s) and NCCL cannot put two ranks on one "
                    f"GPU: this demo runs {wanted} ranks on the CPU with gloo")


def cuda_unusable_note(nvml_gpus: int, torch_sees_gpu: bool, torch_cuda: str | None) -> str:
    """One line when the node has GPUs that this torch cannot use, else "".

    NVML (the driver's management library) counts the GPUs; the CUDA runtime inside torch
    must also be able to drive them. A torch built for a newer CUDA than the driver supports
    (CUDA 13 wheels need driver 580 or newer) sees none, and ``auto`` would train on the CPU
    without a word.
    """
    if nvml_gpus <= 0 or torch_sees_gpu:
        return ""
    if torch_cuda is None:
        return (f"this node has {nvml_gpus} GPU(s) but this torch is a CPU-only build: install a CUDA build "
                "of torch (see envs/) to use them; running on the CPU")
    return (f"this node has {nvml_gpus} GPU(s) but torch (built for CUDA {torch_cuda}) cannot use them: the "
            "NVIDIA driver is probably older than that CUDA needs (nvidia-smi shows its version; CUDA 13 needs "
            "driver 580 or newer). Load a newer driver/CUDA module or install a torch built for an older CUDA; "
            "running on the CPU")


@dataclass(frozen=True)
class VisibleGpu:
    """What CUDA reports of one GPU this process sees (``torch.cuda.get_device_properties``)."""

    uuid: str  # as torch writes it, bare: "58d1c6a0-..."; a MIG slice may report its own
    pci: str = ""  # "domain:bus:device" of the physical GPU: MIG slices of one GPU share it
    name: str = ""  # "NVIDIA A100-SXM4-40GB MIG 3g.20gb" on a slice


def gpu_ids(gpus: Sequence[VisibleGpu], visible_devices: str | None) -> tuple[str, ...]:
    """What :func:`place_ranks` compares for the GPUs this process sees, in CUDA's index order.

    A GPU is its UUID, as CUDA reports it for the device it opened, whatever ``CUDA_VISIBLE_DEVICES``
    (``visible_devices``) called it: an index, renumbered by Slurm's cgroups, or a ``GPU-`` UUID. A MIG slice
    (the variable names ``MIG-`` devices, or the device's name says MIG where Slurm renumbers) is its physical
    GPU's PCI address, which its sibling slices share: NCCL tells GPUs apart by PCI bus and cannot put two
    ranks on slices of one GPU (NVIDIA/nccl#1716).
    """
    mig = (visible_devices or "").strip().startswith("MIG-")
    return tuple(f"pci {g.pci}" if (mig or " MIG " in f" {g.name} ") and g.pci else str(g.uuid) for g in gpus)


_warned_unusable = False


def local_view() -> RankView:
    """What this process sees: its host name and its visible GPUs (:func:`gpu_ids`; starts CUDA in this process)."""
    import os
    import socket
    import sys

    import torch

    global _warned_unusable
    gpus: tuple[str, ...] = ()
    if torch.cuda.is_available():
        seen = []
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            pci = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}" if hasattr(p, "pci_bus_id") else ""
            seen.append(VisibleGpu(str(p.uuid), pci, p.name))
        gpus = gpu_ids(seen, os.environ.get("CUDA_VISIBLE_DEVICES"))
    elif not _warned_unusable:
        note = cuda_unusable_note(torch.cuda.device_count(), False, torch.version.cuda)
        if note:
            print(f"note: {note}", file=sys.stderr, flush=True)
            _warned_unusable = True
    return RankView(socket.gethostname(), gpus)


DEVICE_HELP = ("auto (default: a GPU per rank when each host has enough, else CPU with gloo), "
               "cpu, cuda or cuda:N")


def add_device_flag(parser) -> None:
    """``--device auto|cpu|cuda|cuda:N`` with the policy's meaning, for every script that starts ranks."""
    parser.add_argument("--device", default="auto", help=DEVICE_HELP)


def gpus_bound(env: Mapping[str, str]) -> bool:
    """Whether Slurm shows each task only its own GPU(s): ``--gpus-per-task`` or ``--gpu-bind``
    (the course's ``COURSE_GPU_BIND`` sets ``SLURM_GPU_BIND``). Each task's GPU is then its ``cuda:0``."""
    bind = env.get("SLURM_GPU_BIND", "").strip().lower()
    return "SLURM_GPUS_PER_TASK" in env or (bind not in ("", "none") and not bind.startswith("none"))


def node_device(requested: str, ranks_on_node: int, gpus: int, local_rank: int, bound: bool = False) -> str:
    """The device of a rank whose process group a framework forms (Lightning, Fabric), from this
    process's own view: ``gpus`` visible to it, the ranks on its node, its local rank, and whether
    Slurm binds a GPU to each task (:func:`gpus_bound`).

    Unbound, every rank sees all the node's GPUs and takes ``cuda:LOCAL_RANK`` when there is one
    for each rank. Bound, each rank sees only its own: ``cuda:0``. Otherwise every rank of the node
    gets the CPU (gloo), so a group is never split between NCCL and gloo; ``cuda`` then raises
    :class:`PlacementError`. Scripts that form their own group are placed by :func:`place_ranks`
    (GPU UUIDs compared across ranks) through ``course_utils.process_group.init_distributed``.
    """
    requested = _check_requested(requested)
    if requested == "cpu":
        return "cpu"
    if bound and gpus > 1 and not requested.startswith("cuda:"):
        # --gpu-bind=closest shows a task every GPU near its cores: two tasks of a socket see the same two GPUs,
        # and which one is whose is known only when the ranks compare (place_ranks, in the course's own scripts)
        raise PlacementError(f"Slurm binds {gpus} GPUs to this task (--gpu-bind=closest, or --gpus-per-task="
                             f"{gpus}), and a framework that forms its own group cannot tell which is this rank's: "
                             "bind one GPU per task (COURSE_GPU_BIND=single:1, or --gpus-per-task=1) or none")
    if bound and gpus >= 1:
        if requested.startswith("cuda:") and int(requested[5:]) >= gpus:
            raise PlacementError(f"--device {requested}, but Slurm binds {gpus} GPU(s) to this task (cuda:0 to "
                                 f"cuda:{gpus - 1})")
        return requested if requested.startswith("cuda:") else "cuda:0"
    if gpus >= ranks_on_node and gpus > 0:
        return requested if requested.startswith("cuda:") else f"cuda:{local_rank}"
    if requested.startswith("cuda"):
        if gpus == 0:
            raise PlacementError("--device cuda, but this process sees no GPU: run on a GPU node (ask Slurm for "
                                 "GPUs: --gres=gpu:N or --gpus-per-node=N), or use --device cpu")
        raise PlacementError(f"{ranks_on_node} ranks on this node but {gpus} GPU(s): start at most one rank per GPU")
    return "cpu"
