"""A notebook's first cell: what this session runs on, chosen once by the course's device policy and said in a line
(the profile, the ranks and their device, the hardware label every measured number carries). The bench stays here.

    SESSION = setup(ranks=2, per_gpu=pick(ci=False, full=True), minimum=2, fallback="cap", data=True)
    # profile ci: 2 ranks on CPU AMD EPYC 7B13 (2 cores), gloo
    # data: the offline synthetic set (CI profile)

For ranks, no CUDA starts here: the GPUs are read in a child process (environment_report), so the kernel can still
fork ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .devices import DemoPlan, plan_demo
from .hardware import environment_report, hardware_label
from .sizing import current_profile, pick

@dataclass(frozen=True)
class Session:
    """What a notebook runs on: ``device`` ("cuda" or "cpu") is what its scripts get as --device."""

    profile: str
    ranks: int
    device: str
    backend: str | None  # None: one process, no process group
    hardware: str  # the label every measured number carries
    gpus: int  # the GPUs this session sees
    note: str  # one line where the device policy chose other than what was asked
    env: dict[str, Any]  # environment_report()
    dataset: str | None = None  # "cifar10" or "synthetic", with data=True

    @property
    def on_gpu(self) -> bool:
        return self.device == "cuda"

    @property
    def label(self) -> str:
        """``2 rank(s), gloo on CPU``: what a demo's results are labelled with."""
        return f"{self.ranks} rank(s), {self.backend or 'no group'} on {'GPUs' if self.on_gpu else 'CPU'}"


def plan_ranks(ranks: int, per_gpu: bool, minimum: int, fallback: str, gpus: int) -> DemoPlan:
    """setup()'s choice for ``ranks``, a pure function of the GPUs here (tests evaluate it for each course machine)."""
    return plan_demo(max(ranks, gpus) if per_gpu else ranks, gpus, minimum=minimum, fallback=fallback)


def setup(ranks: int | None = None, *, per_gpu: bool = False, minimum: int = 1, fallback: str = "cpu",
          data: bool = False) -> Session:
    """Choose what this notebook runs on, print it, and return it.

    ``ranks=None``: one process, on its first GPU, else the CPU. ``ranks=N``: an N-rank demo (``per_gpu``: or one
    rank per GPU where there are more), one rank per GPU; with fewer GPUs, ``fallback="cap"`` runs one per GPU where
    that is at least ``minimum``, ``"cpu"`` runs N gloo ranks on the CPU (NCCL never puts two ranks on one GPU).
    ``data``: the data set too, CIFAR-10 in the full profile once downloaded on a login node, else the offline set.
    """
    env = environment_report()
    gpus, profile = len(env["gpus"]), current_profile()
    if ranks is None:  # the one policy's device for this process (CUDA starts here: a notebook training in its kernel)
        from .process_group import choose_device

        device = choose_device("auto").type
        n, backend, note = 1, None, ""
        hardware = hardware_label(env, device)
        said = f"profile {profile}, device {device}: {hardware}"
    else:
        plan = plan_ranks(ranks, per_gpu, minimum, fallback, gpus)
        n, device, backend, note = plan.nproc, plan.device, plan.backend, plan.note
        hardware = hardware_label(env, device, ranks=n, backend=backend)
        said = f"profile {profile}: {n} ranks on {hardware}"
    print(said)
    dataset = None
    if data:
        from .data import workshop_dataset

        dataset, line = workshop_dataset(full=pick(ci=False, full=True, device=device))
        print(line)
    if note:
        print("note:", note)
    return Session(profile, n, device, backend, hardware, gpus, note, env, dataset)
