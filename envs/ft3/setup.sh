#!/bin/bash
# CESGA FT3: create the course's conda environment (on a login node; takes several minutes).
#   bash envs/ft3/setup.sh          PACK=1 bash envs/ft3/setup.sh   (also a conda-pack tarball)
set -euo pipefail
export COURSE_CLUSTER=ft3
export COURSE_MODULES="${COURSE_MODULES-cesga/system miniconda3/22.11}"
if [[ -z "${COURSE_CONDA_ENV:-}" && -z "${STORE:-}" ]]; then
    echo "error: run this on FT3, where \$STORE is set (or set COURSE_CONDA_ENV to the env's path)" >&2
    exit 2
fi
export COURSE_CONDA_ENV="${COURSE_CONDA_ENV:-$STORE/conda/envs/distdl}"
# the srun that reaches one A100, for the check the setup prints at its end
export COURSE_GPU_CHECK="${COURSE_GPU_CHECK-srun -N1 -n1 -t 5 --gres=gpu:a100:1}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/../setup_conda.sh"
