"""Stop at the next step when the scheduler warns that time is running out.

Slurm can send a signal before a job's time limit (``#SBATCH --signal=USR1@120``
to the ranks, or ``B:USR1@120`` to the batch shell, which passes it on). A job
that then checkpoints *at its next step* and exits loses seconds of work, not
an epoch, and the requeued job resumes mid-epoch.

The signal may reach the ranks at different moments, so they must agree on
the step at which to stop, or one would wait forever in a collective the
others never join. :class:`StopRequest` all-reduces each rank's flag once per
step on a small gloo group of its own (CPU tensors: no GPU synchronisation),
started at one step and read at the next, so the agreement never stalls the
training loop; every rank sees the same answer at the same step.
"""

from __future__ import annotations

import signal
from types import FrameType

import torch
import torch.distributed as dist

from . import process_group as cdist


class StopRequest:
    """``poll()`` once per optimiser step on every rank: True on all ranks at the same step
    once any rank has been signalled (or :meth:`ask` was called)."""

    ASKED = 255  # a stop asked for in code, not by a signal (signal numbers are smaller)

    def __init__(self) -> None:
        self.code = 0  # 0: go on; a signal number, or ASKED

        self._group = None
        self._pending: tuple[dist.Work, torch.Tensor] | None = None
        if cdist.get_world_size() > 1:
            # a collective: every rank builds its Trainer, hence its StopRequest, in the same order
            self._group = dist.new_group(backend="gloo")

    def install(self, signum: int = signal.SIGUSR1) -> None:
        """Ask for a stop when this process receives ``signum``."""
        def handler(num: int, frame: FrameType | None) -> None:
            self.code = self.code or num

        signal.signal(signum, handler)

    def ask(self) -> None:
        self.code = self.code or self.ASKED

    @property
    def reason(self) -> str:
        """What asked for the stop (on every rank once agreed): a signal's name, or "asked"."""
        if self.code in (0, self.ASKED):
            return "asked" if self.code else "not asked"
        return signal.Signals(self.code).name

    def poll(self) -> bool:
        """Whether every rank should stop now (the agreement started at the previous step)."""
        if self._group is None:
            return bool(self.code)
        stop = False
        if self._pending is not None:
            work, flag = self._pending
            work.wait()
            agreed = int(flag.item())  # the largest code any rank had: the same on every rank
            if agreed:
                stop, self.code = True, agreed
        flag = torch.tensor([self.code], dtype=torch.int32)
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._group, async_op=True), flag)
        return stop

    def close(self) -> None:
        """Finish the agreement still in flight (every rank has exactly one)."""
        if self._pending is not None:
            self._pending[0].wait()
            self._pending = None
