# shellcheck shell=bash
# TACC Frontera: activate the course environment in an interactive shell or job:  source envs/frontera/activate.sh
# The sbatch scripts in slurm/frontera/ do the same through COURSE_MODULES / COURSE_CONDA_ENV.
export COURSE_MODULES="${COURSE_MODULES-}"
export COURSE_CONDA_ENV="${COURSE_CONDA_ENV:-${WORK:-$HOME}/conda/envs/distdl}"
if [[ -n "$COURSE_MODULES" ]] && type module >/dev/null 2>&1; then
    # shellcheck disable=SC2086  # a list of module names
    module load $COURSE_MODULES
fi
eval "$(conda shell.bash hook)" && conda activate "$COURSE_CONDA_ENV"
