"""The machines a workshop runs the full profile on, as facts: what ``tests/test_full_profile.py``
computes each notebook's layouts for, without a GPU (issue 31).

One frozen record per target. Facts are the vendors' and the sites' (``slurm/sites/*.toml`` says
the same GPUs and cores per node: a test holds the two together). The throughputs are sustained
dense-matmul rates, for time estimates only; a training step reaches a share of them
(``tests/test_full_profile.py`` states which).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    name: str
    nodes: int  # nodes a job gets; a notebook's kernel runs on one of them
    gpus_per_node: int
    gpu: str
    gpu_memory_gib: float  # per GPU, as sold: the driver and the CUDA context take some (the tests keep a margin)
    capability: tuple[int, int]  # CUDA compute capability
    bf16: bool  # bf16 tensor cores, from the data sheet (course_utils.precision decides from the capability)
    cores_per_node: int  # the cores a job on the node may use
    tflops_fp32: float  # sustained fp32 matmul, no tensor cores (TF32 left out: errs slow)
    tflops_amp: float  # sustained bf16 matmul, or fp16 where the GPU has no bf16
    site: str | None = None  # slurm/sites/<site>.toml, for a cluster

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


# A Jupyter portal's 1-GPU session. Assumed: one A100-40GB and 8 cores (a portal hands out a share of
# a node); correct it here when a portal's facts are known.
PORTAL = Target("portal", nodes=1, gpus_per_node=1, gpu="A100 40GB (assumed)", gpu_memory_gib=40,
                capability=(8, 0), bf16=True, cores_per_node=8, tflops_fp32=19.5, tflops_amp=150)
# One H100 80GB with 16 cores (the GPU machine this project is lent now and then).
H100 = Target("h100", nodes=1, gpus_per_node=1, gpu="H100 80GB HBM3", gpu_memory_gib=80, capability=(9, 0),
              bf16=True, cores_per_node=16, tflops_fp32=50, tflops_amp=400)
# CESGA FT3: A100-40GB nodes, 2 GPUs and 64 cores each; the course's 2-node jobs.
FT3 = Target("ft3", nodes=2, gpus_per_node=2, gpu="A100 40GB", gpu_memory_gib=40, capability=(8, 0),
             bf16=True, cores_per_node=64, tflops_fp32=19.5, tflops_amp=150, site="ft3")
# TACC Frontera, rtx queue: 4 Quadro RTX 5000 (Turing, 16 GB, no bf16) and 16 cores per node.
FRONTERA = Target("frontera", nodes=2, gpus_per_node=4, gpu="Quadro RTX 5000", gpu_memory_gib=16,
                  capability=(7, 5), bf16=False, cores_per_node=16, tflops_fp32=11, tflops_amp=45,
                  site="frontera")

TARGETS = (PORTAL, H100, FT3, FRONTERA)
CLUSTERS = tuple(t.site for t in TARGETS if t.site)  # the sites in slurm/sites/ a workshop runs on
