"""Pipeline parallelism on the decoder: the model cut into consecutive stages, one per ``pp`` rank, and a
schedule that streams micro-batches through them (``torch.distributed.pipelining``; torchtitan's manual split).

The first stage holds the embedding, the last the final norm and the head, each stage its share of the blocks.
A stage keeps the whole model's parameter names (``layers.1.attention.wq.weight``), so the stages' sharded
checkpoints are together the unsplit model's and resume on any layout. GPipe runs every micro-batch's forward
before any backward; 1F1B alternates them once the pipeline is full and holds at most ``pp`` micro-batches'
activations instead of all of them. With ``scale_grads`` (the default) the schedule divides the summed
gradients by the micro-batches: the mean loss's gradient, as in the unsplit step.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B"}


def stage_layers(layers: int, stages: int, stage: int) -> list[str]:
    """The names of the blocks stage ``stage`` of ``stages`` holds: consecutive, as even as they go."""
    bounds = [round(k * layers / stages) for k in range(stages + 1)]
    return [str(i) for i in range(bounds[stage], bounds[stage + 1])]


def cut(model: nn.Module, stages: int, stage: int) -> nn.Module:
    """Keep only stage ``stage``'s part of ``model`` (in place): its blocks, the embedding on the first stage,
    the final norm and the head on the last. The decoder's forward skips the parts that are ``None``."""
    keep = set(stage_layers(len(model.layers), stages, stage))
    for name in [n for n in model.layers if n not in keep]:
        del model.layers[name]
    if stage > 0:
        model.tok_embeddings = None
    if stage < stages - 1:
        model.norm, model.output = None, None
    return model


def build_schedule(model: nn.Module, stage: int, stages: int, pp_mesh, device: torch.device, microbatches: int,
                   loss_fn: Callable, name: str = "1f1b"):
    """``name``'s schedule over this rank's stage; ``loss_fn(output, target)`` runs on the last stage."""
    from torch.distributed import pipelining

    if name not in SCHEDULES:
        raise ValueError(f"--pp-schedule takes {', '.join(SCHEDULES)}, not {name!r}")
    piece = pipelining.PipelineStage(model, stage, stages, device, group=pp_mesh.get_group())
    return getattr(pipelining, SCHEDULES[name])(piece, n_microbatches=microbatches, loss_fn=loss_fn)


def _through(run, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    losses: list[torch.Tensor] = []
    inputs = (x,) if stage == 0 else ()  # the first stage feeds the inputs, the last computes the loss
    if stage == stages - 1:
        run(*inputs, target=y, losses=losses)
    else:
        run(*inputs)
    return losses


def pipeline_step(schedule, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor]:
    """One forward and backward of the whole batch through the pipeline: the first stage feeds ``x``, the last
    computes the loss on ``y`` and returns the micro-batches' losses (the other stages: ``[]``)."""
    return _through(schedule.step, stage, stages, x, y)


def pipeline_eval(schedule, stage: int, stages: int, x: torch.Tensor, y: torch.Tensor) -> list[torch.Tensor] | None:
    """The micro-batches' losses of a forward-only pass (the last stage; ``[]`` elsewhere), or ``None`` where
    this torch's schedules have no ``eval`` (older releases)."""
    return _through(schedule.eval, stage, stages, x, y) if hasattr(schedule, "eval") else None
