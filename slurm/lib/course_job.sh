# shellcheck shell=bash
# Sourced by every sbatch script in slurm/. One place for what all of them do:
#   course_activate    the environment hook (modules + conda where they exist, .venv otherwise)
#   course_rendezvous  MASTER_ADDR = first node of the job, MASTER_PORT derived from the job id
#   SRUN_CPUS_PER_TASK every srun task gets the job's --cpus-per-task (Slurm >= 22.05 needs this)
#   COURSE_RUNS        where checkpoints and TensorBoard logs go
#   TRAIN_ARGS         the arguments for scripts/train.py (override with sbatch --export=ALL,TRAIN_ARGS=...)
# The scripts themselves only choose resources and a launch pattern.

set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: this is a Slurm batch script: submit it with 'sbatch $0' (from the repository root)," \
         "or run scripts/train.py directly outside Slurm." >&2
    exit 2
fi

# sbatch runs a copy of the script from a spool folder; the repository is where sbatch was called.
COURSE_ROOT="${COURSE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
if [[ ! -f "$COURSE_ROOT/scripts/train.py" ]]; then
    echo "error: $COURSE_ROOT is not the course repository: submit from its root or set COURSE_ROOT" >&2
    exit 2
fi
cd "$COURSE_ROOT"
export PYTHONPATH="$COURSE_ROOT/notebooks${PYTHONPATH:+:$PYTHONPATH}"

# The one environment hook. Clusters set COURSE_MODULES / COURSE_CONDA_ENV (see the
# scripts' defaults, and envs/); anywhere else the project's .venv is used.
course_activate() {
    if [[ -n "${COURSE_MODULES:-}" ]] && type module >/dev/null 2>&1; then
        # shellcheck disable=SC2086  # a list of module names
        module load $COURSE_MODULES
    fi
    if [[ -n "${COURSE_CONDA_ENV:-}" ]] && [[ -d "$COURSE_CONDA_ENV" ]] && type conda >/dev/null 2>&1; then
        eval "$(conda shell.bash hook)"
        conda activate "$COURSE_CONDA_ENV"
    elif [[ -x "$COURSE_ROOT/.venv/bin/python" ]]; then
        # shellcheck disable=SC1091
        source "$COURSE_ROOT/.venv/bin/activate"
    else
        echo "error: no Python environment found: create the conda env (envs/README.md) and set" \
             "COURSE_CONDA_ENV, or run 'make setup' for the project's .venv" >&2
        exit 2
    fi
    echo "python: $(command -v python)"
}

# Same rule as course_utils.dist.port_from_job_id: two jobs on a node never share a port.
course_rendezvous() {
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
    export MASTER_ADDR MASTER_PORT
    echo "job $SLURM_JOB_ID on ${SLURM_JOB_NUM_NODES:-1} node(s): $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT"
}

# Since Slurm 22.05, srun no longer inherits sbatch's --cpus-per-task: without this, every
# rank started by srun (and all its DataLoader workers) would share a single core.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# Optional GPU binding for srun (e.g. COURSE_GPU_BIND=closest where the cluster's gres.conf
# records GPU affinity): each task then sees only its own GPU, as its cuda:0. The course's
# scripts place ranks by GPU UUID and handle both; a script that picks cuda:$LOCAL_RANK does not.
if [[ -n "${COURSE_GPU_BIND:-}" ]]; then
    export SLURM_GPU_BIND="$COURSE_GPU_BIND"
fi

COURSE_RUNS="${COURSE_RUNS:-$COURSE_ROOT/runs}"
RUN_DIR="$COURSE_RUNS/${SLURM_JOB_NAME:-job}-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}"
TRAIN_ARGS="${TRAIN_ARGS:---model resnet18 --epochs 10 --precision amp --channels-last --workers 4}"
# shellcheck disable=SC2034  # used by the scripts that source this file
read -r -a TRAIN_ARGV <<< "$TRAIN_ARGS"   # the flags as an array: "${TRAIN_ARGV[@]}"
export COURSE_RUNS RUN_DIR TRAIN_ARGS
