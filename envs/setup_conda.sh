#!/bin/bash
# Create (or update) the course's conda environment. Called by envs/<cluster>/setup.sh,
# which sets where it goes; run it on a LOGIN node (it downloads packages).
#   COURSE_CLUSTER     ft3 | frontera (which environment.yml)
#   COURSE_CONDA_ENV   the env's prefix: in $STORE (FT3) or $WORK (Frontera), never $HOME's small quota
#   COURSE_MODULES     modules to load first (FT3: cesga/system miniconda3/22.11)
#   PACK=1             also write a conda-pack tarball next to the env (copy it to node-local disk in jobs)
#   COURSE_CUDA_DRIVER the compute nodes' NVIDIA driver version, where this login node has no nvidia-smi
#   COURSE_GPU_CHECK   the srun that reaches one GPU (set by envs/<cluster>/setup.sh)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
: "${COURSE_CLUSTER:?set by envs/<cluster>/setup.sh}"
: "${COURSE_CONDA_ENV:?set by envs/<cluster>/setup.sh}"

if [[ -n "${COURSE_MODULES:-}" ]]; then
    if ! type module >/dev/null 2>&1; then
        echo "error: 'module' is not available here; are you on the $COURSE_CLUSTER login node?" >&2
        exit 2
    fi
    # shellcheck disable=SC2086  # a list of module names
    module load $COURSE_MODULES
fi
if ! type conda >/dev/null 2>&1; then
    echo "error: conda not found. FT3: module load cesga/system miniconda3/22.11;" \
         "Frontera: install Miniforge into \$WORK (see envs/README.md)" >&2
    exit 2
fi
eval "$(conda shell.bash hook)"
# package cache beside the env, not in $HOME
export CONDA_PKGS_DIRS="${CONDA_PKGS_DIRS:-$(dirname "$COURSE_CONDA_ENV")/pkgs}"
SPEC="$ROOT/envs/$COURSE_CLUSTER/environment.yml"
if [[ -d "$COURSE_CONDA_ENV" ]]; then
    conda env update --prefix "$COURSE_CONDA_ENV" --file "$SPEC" --prune
else
    conda env create --prefix "$COURSE_CONDA_ENV" --file "$SPEC"
fi
conda activate "$COURSE_CONDA_ENV"
# The pins of pyproject.toml with the versions of everything they pull in (constraints.txt): the set the
# course's tests passed with. torch first, in the build the GPU driver can run (envs/cuda_build.py says which,
# in one line; COURSE_CUDA_DRIVER: the compute nodes' driver where this login node has no nvidia-smi).
TORCH_PINS=$(python -c "import tomllib; print(' '.join(d for d in tomllib.load(open('$ROOT/pyproject.toml', 'rb'))['project']['dependencies'] if d.startswith(('torch==', 'torchvision=='))))")
TORCH_BUILD=$(python "$ROOT/envs/cuda_build.py" ${COURSE_CUDA_DRIVER:+--driver "$COURSE_CUDA_DRIVER"})
# shellcheck disable=SC2086  # the pins and the index flags are lists of words
python -m pip install -c "$ROOT/constraints.txt" $TORCH_BUILD $TORCH_PINS
# course_utils for scripts and sbatch jobs, and every other pin (torch stays the build just installed)
python -m pip install -c "$ROOT/constraints.txt" -e "${ROOT}[lab,test]"
# so that the cluster's Jupyter portal offers this environment as a kernel
python -m ipykernel install --user --name distdl --display-name "Distributed DL course ($COURSE_CLUSTER)"
python -c "import torch, torchvision, course_utils; print('torch', torch.__version__, '| CUDA build', torch.version.cuda)"
echo "check it on a compute node, in one command: ${COURSE_GPU_CHECK:-srun -N1 -t 5 --gres=gpu:1} $COURSE_CONDA_ENV/bin/python -c 'import torch; print(torch.cuda.is_available(), torch.version.cuda)'"
if [[ "${PACK:-0}" == 1 ]]; then
    conda install -y -n base conda-pack 2>/dev/null || conda install -y conda-pack
    conda pack --prefix "$COURSE_CONDA_ENV" --output "$COURSE_CONDA_ENV.tar.gz" --force
    echo "packed: $COURSE_CONDA_ENV.tar.gz (unpack to \$TMPDIR in a job, then source bin/activate)"
fi
echo "done. In jobs and shells: source envs/$COURSE_CLUSTER/activate.sh"
