#!/bin/bash
# TACC Frontera: create the course's conda environment (on a login node; takes several minutes).
#   bash envs/frontera/setup.sh          PACK=1 bash envs/frontera/setup.sh   (also a conda-pack tarball)
set -euo pipefail
export COURSE_CLUSTER=frontera
export COURSE_MODULES="${COURSE_MODULES-}"
if [[ -z "${COURSE_CONDA_ENV:-}" && -z "${WORK:-}" ]]; then
    echo "error: run this on Frontera, where \$WORK is set (or set COURSE_CONDA_ENV to the env's path)" >&2
    exit 2
fi
export COURSE_CONDA_ENV="${COURSE_CONDA_ENV:-$WORK/conda/envs/distdl}"
# the srun that reaches one RTX 5000, for the check the setup prints at its end
export COURSE_GPU_CHECK="${COURSE_GPU_CHECK-srun -p rtx-dev -N1 -n1 -t 5}"
exec bash "$(dirname "${BASH_SOURCE[0]}")/../setup_conda.sh"
