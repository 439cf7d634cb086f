"""Every parallelism of the course's transformer in one short file, all on one mesh (``scripts/train_lm.py``)::

    dims            ParallelDims: the degrees, checked against the world size and the model; the named mesh
    fsdp            apply_fsdp: FSDP2 per block, mixed precision, HSDP on a 2-D mesh, CPU offload
    tensor          apply_tp: Megatron's plans for attention and SwiGLU, sequence-parallel norms, a vocab-split
                    embedding and head for loss_parallel
    context         ring_attention: each rank a share of the sequence, keys and values passed round a ring,
                    the zig-zag split that balances causal attention; apply_cp
    experts         MoE: a router, top-k experts, a capacity and the balancing loss; apply_ep spreads the experts
                    over ranks, tokens dispatched and combined with all_to_all_single
    pipeline        cut: the decoder's stages (embedding first, head last); GPipe and 1F1B schedules
    checkpointing   apply_ac: activation checkpointing per block, full or selective
    parallelize     parallelize(model, dims, mesh): them all, in torchtitan's order (with float8 and compile);
                    clip_grad_norm over them all
"""

from .checkpointing import AC_MODES, apply_ac
from .context import LAYOUTS, apply_cp, ring_attention
from .dims import MESH_DIMS, ParallelDims
from .experts import MoE, apply_ep
from .fsdp import apply_fsdp
from .parallelize import clip_grad_norm, float8_problem, parallelize
from .pipeline import SCHEDULES, build_schedule, cut, pipeline_eval, pipeline_step, stage_layers
from .tensor import apply_tp, block_plan, outer_plan

__all__ = ["AC_MODES", "LAYOUTS", "MESH_DIMS", "SCHEDULES", "MoE", "ParallelDims", "apply_ac", "apply_cp",
           "apply_ep", "apply_fsdp", "apply_tp", "block_plan", "build_schedule", "clip_grad_norm", "cut",
           "float8_problem", "outer_plan", "parallelize", "pipeline_eval", "pipeline_step", "ring_attention",
           "stage_layers"]
