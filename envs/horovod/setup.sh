#!/bin/bash
# Optional: an environment to run scripts/plain_horovod.py (notebook 09) with a site's own Horovod.
# Horovod's last release (0.28.1, June 2023) does not build against torch >= 2.1 from the package
# index (horovod issue 3996: C++17), so the course's pinned torch cannot have it. Where a site ships a
# Horovod module built with its own torch, this layers a small conda env on top of that module's
# Python: the module's torch and Horovod, plus the course's pure-Python needs. Not run by CI (no
# Horovod builds here): checked for syntax only. Run it on a LOGIN node:
#   HOROVOD_MODULES="<the site's modules, e.g. from: module spider horovod>" bash envs/horovod/setup.sh
#   HOROVOD_ENV      the env's prefix (default: $STORE, else $WORK, else $HOME /conda/envs/distdl-horovod)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
: "${HOROVOD_MODULES:?name the Horovod module(s) of the site, see: module spider horovod}"
HOROVOD_ENV="${HOROVOD_ENV:-${STORE:-${WORK:-$HOME}}/conda/envs/distdl-horovod}"

if ! type module >/dev/null 2>&1; then
    echo "error: 'module' is not available here: run this on the cluster's login node" >&2
    exit 2
fi
# shellcheck disable=SC2086  # a list of module names
module load $HOROVOD_MODULES
# the module's Horovod must work with the module's torch before anything is installed
if ! python -c "import torch, horovod.torch as hvd; print('torch', torch.__version__, '| horovod', hvd.__version__)"; then
    echo "error: the modules '$HOROVOD_MODULES' give no working horovod.torch; ask the site's support for a" \
         "Horovod built with their PyTorch (pip cannot build 0.28.1 against torch >= 2.1: horovod issue 3996)" >&2
    exit 2
fi
if ! type conda >/dev/null 2>&1; then
    echo "error: conda not found (FT3: module load cesga/system miniconda3/22.11; Frontera: Miniforge in \$WORK)" >&2
    exit 2
fi
eval "$(conda shell.bash hook)"
export CONDA_PKGS_DIRS="${CONDA_PKGS_DIRS:-$(dirname "$HOROVOD_ENV")/pkgs}"
PY_VERSION="$(python -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
SITE_PACKAGES="$(python -c 'import horovod, os; print(os.path.dirname(os.path.dirname(horovod.__file__)))')"
[[ -d "$HOROVOD_ENV" ]] || conda create -y --prefix "$HOROVOD_ENV" "python=$PY_VERSION" pip
conda activate "$HOROVOD_ENV"
# the module's packages (torch, horovod) visible in the env, ahead of nothing the env installs
python - "$SITE_PACKAGES" <<'PY'
import site, sys
from pathlib import Path
Path(site.getsitepackages()[0], "site-module.pth").write_text(sys.argv[1] + "\n")
PY
python -m pip install --no-deps -e "$ROOT"
python -m pip install tqdm==4.70.1 python-hostlist==2.3.0  # what course_utils needs beyond torch and numpy
python -c "import torch, horovod.torch, course_utils; print('ready: torch', torch.__version__)"
echo "done. In a job: module load $HOROVOD_MODULES; conda activate $HOROVOD_ENV;" \
     "srun python scripts/plain_horovod.py"
