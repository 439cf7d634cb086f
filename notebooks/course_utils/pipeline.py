"""Pipeline parallelism with ``torch.distributed.pipelining`` (notebook 09, ``scripts/train_pipeline.py``).

A model too large for one device is cut into consecutive *stages*, one per rank; a batch is cut
into *micro-batches* that flow through the stages, so that stage 2 works on micro-batch 1 while
stage 1 works on micro-batch 2. Until the pipeline is full and after it drains, some stages wait:
the *bubble*, a fraction (p-1)/(m+p-1) of the step for p stages and m micro-batches, whatever the
schedule. GPipe runs every forward, then every backward (each stage holds the activations of all m
micro-batches); 1F1B alternates one forward and one backward once the pipeline is full (stage s of p
holds at most p-s). The interleaved 1F1B gives each rank several smaller stages (model chunks), so
that the pipeline fills and drains in smaller slots.

:class:`SimulatedWork` stands in for a stage's compute with a fixed time per micro-batch, forward
and backward, so that the schedule's bubble is measured as the schedule makes it and not as a
machine's cores happen to be shared; it also counts the micro-batches whose activations a stage
holds, and records when each pass ran (the schedule drawn in notebook 09). The stages' real layers run as well: the pipeline's losses and gradients are compared with
the unsplit model's.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import nn


SCHEDULES = ("gpipe", "1f1b")  # one stage per rank: what --train runs
TIMED = (*SCHEDULES, "interleaved")  # and 1F1B over several model chunks per rank, timed beside them
CHUNKS = 2  # model chunks per rank under the interleaved schedule (Megatron-LM's "virtual stages", v)


def chunks(schedule: str) -> int:
    """Model chunks (pipeline stages) each rank runs under ``schedule``."""
    return CHUNKS if schedule == "interleaved" else 1


def rank_stages(schedule: str, rank: int, ranks: int) -> list[int]:
    """The pipeline stages rank ``rank`` runs: its own, or under the interleaved schedule every
    ``ranks``-th of ``CHUNKS * ranks`` (rank 0 of 4: stages 0 and 4), so that a micro-batch goes
    round the ranks ``CHUNKS`` times."""
    return [rank + k * ranks for k in range(chunks(schedule))]


def bubble_theory(stages: int, microbatches: int, chunks: int = 1) -> float:
    """The share of a pipeline step each of ``stages`` ranks waits, when every micro-batch takes the same
    time per rank, split evenly over ``chunks`` model chunks per rank (the exercise of notebook 09)."""
    return (stages - 1) / (chunks * microbatches + stages - 1)


def held_theory(schedule: str, stages: int, microbatches: int, stage: int) -> int:
    """Micro-batches whose activations stage ``stage`` holds at most: all of them under GPipe, under
    1F1B the ones in flight between its first forward and its first backward."""
    return microbatches if schedule == "gpipe" else min(microbatches, stages - stage)


def schedule_order(schedule: str, stages: int, microbatches: int, stage: int) -> list[str]:
    """The order in which stage ``stage`` runs its passes: ``F3`` is micro-batch 3's forward, ``B3`` its
    backward. GPipe: every forward, then every backward. 1F1B: the forwards that fill the pipeline below
    this stage (p - s of them), then one backward and one forward in turn, then the backwards left."""
    forwards = [f"F{i}" for i in range(microbatches)]
    backwards = [f"B{i}" for i in range(microbatches)]
    if schedule == "gpipe":
        return forwards + backwards
    warmup = min(microbatches, stages - stage)
    order = forwards[:warmup]
    for i in range(microbatches - warmup):
        order += [backwards[i], forwards[warmup + i]]
    return order + backwards[microbatches - warmup:]


def schedule_class(name: str) -> type:
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

    return {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved": ScheduleInterleaved1F1B}[name]


def min_microbatches(name: str, stages: int) -> int:
    """torch's 1F1B (interleaved too) needs at least one micro-batch per rank; GPipe runs with any number."""
    return 1 if name == "gpipe" else stages


def block_until_ready(x: torch.Tensor) -> None:
    """Hold the CPU until ``x`` is computed and received. Under NCCL a received activation's
    ``Work.wait()`` makes the GPU's stream wait, not the CPU: a compute simulated by a CPU sleep would
    start before its input arrived, the stages' sleeps would overlap, and the bubble would measure 0.
    So the CPU waits for this stream, not the whole GPU: torch's interleaved schedule posts the receives of
    later micro-batches early, on NCCL's streams, and ``torch.cuda.synchronize`` would wait for those too
    (for the neighbour's unrelated compute), inflating the bubble. (With gloo, ``wait()`` has blocked the CPU.)"""
    if x.device.type == "cuda":
        torch.cuda.current_stream(x.device).synchronize()


class SimulatedWork(torch.autograd.Function):
    """Identity on the activations; sleeps ``forward_s`` in the forward pass and twice that in the
    backward (a backward pass costs about two forwards), and counts micro-batches held in ``meter``.
    Each sleep starts once its input is there (:func:`block_until_ready`), as a GPU kernel would."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, meter: dict) -> torch.Tensor:
        ctx.forward_s, ctx.meter, ctx.index = forward_s, meter, meter["forwards"]
        block_until_ready(x)
        start = time.perf_counter()
        time.sleep(forward_s)
        meter["events"].append((f"F{ctx.index}", start, time.perf_counter()))
        meter["forwards"] += 1
        meter["held"] += 1
        meter["peak"] = max(meter["peak"], meter["held"])
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        block_until_ready(grad)
        start = time.perf_counter()
        time.sleep(2 * ctx.forward_s)
        ctx.meter["events"].append((f"B{ctx.index}", start, time.perf_counter()))
        ctx.meter["held"] -= 1
        return grad, None, None


class Stage(nn.Module):
    """A stage: its share of the layers, then the simulated compute and the count of activations held."""

    def __init__(self, layers: nn.Module, forward_s: float = 0.0) -> None:
        super().__init__()
        self.layers, self.forward_s = layers, forward_s
        self.meter: dict = {}
        self.reset_meter()

    def reset_meter(self) -> None:
        """Count afresh: micro-batches held (now and at most), forwards run, and each pass's
        (name, start, end) on this process's ``time.perf_counter`` clock."""
        self.meter.update(held=0, peak=0, forwards=0, events=[])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.layers(x)
        return SimulatedWork.apply(x, self.forward_s, self.meter) if self.forward_s else x


def build_mlp(hidden: int, layers: int, seed: int = 0) -> nn.Sequential:
    """The unsplit model: ``layers`` blocks of Linear + Tanh, the same weights on every rank (``seed``)."""
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(hidden, hidden), nn.Tanh()) for _ in range(layers)])


def split(model: nn.Sequential, stages: int, stage: int) -> nn.Sequential:
    """Stage ``stage``'s consecutive blocks of ``model`` (the same number for each stage)."""
    if len(model) % stages:
        raise ValueError(f"{len(model)} blocks do not split evenly into {stages} stages")
    per = len(model) // stages
    return model[stage * per:(stage + 1) * per]


class ModelStage(nn.Module):
    """Stage ``stage`` of ``stages`` of the course's ``mlp`` model (``models.MLP``): its units (the stem,
    each residual block, the head) dealt in order, as evenly as they go. The stage keeps the whole
    model's parameter names ("stem.2.weight", "blocks.1.0.weight", "head.bias"), so that the stages'
    state dicts together are the model's: one sharded checkpoint, which ``consolidate_sharded`` turns
    into a plain state dict for the unsplit model."""

    def __init__(self, model: nn.Module, stages: int, stage: int) -> None:
        super().__init__()
        units = ["stem", *(f"blocks.{i}" for i in range(len(model.blocks))), "head"]
        if not 0 <= stage < stages <= len(units):
            raise ValueError(f"the model has {len(units)} units (stem, {len(model.blocks)} blocks, head): "
                             f"at most {len(units)} stages, not {stages}")
        bounds = [round(k * len(units) / stages) for k in range(stages + 1)]
        self.units = units[bounds[stage]:bounds[stage + 1]]
        self.stem = model.stem if "stem" in self.units else None
        self.blocks = nn.ModuleDict({u.split(".")[1]: model.blocks[int(u.split(".")[1])]
                                     for u in self.units if u.startswith("blocks.")})
        self.head = model.head if "head" in self.units else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.stem is not None:
            x = self.stem(x)
        for block in self.blocks.values():
            x = x + block(x)  # the residual connection of models.MLP
        return self.head(x) if self.head is not None else x


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)
