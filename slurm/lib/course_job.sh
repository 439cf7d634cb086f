# shellcheck shell=bash
# Sourced by every sbatch script in slurm/ (written by slurm/generate.py). What every job needs:
#   course_activate    the environment hook (modules + conda where they exist, .venv otherwise)
#   course_rendezvous  MASTER_ADDR = the job's first node, MASTER_PORT = a port free there now
#   course_run_requeueable  run training so that Slurm's warning signal checkpoints and requeues
#   TRAIN_SCRIPT       what to run: the course's scripts/train.py unless set; TRAIN_ARGS its flags
#   RUN_DIR            a folder per job under COURSE_RUNS, created here and exported: the course's scripts put
#                      their checkpoints, logs and searches in it unless their flags say otherwise (your script
#                      may use it too); COURSE_RUN_NAME=NAME makes it COURSE_RUNS/NAME, so a resubmitted job
#                      finds what the last saved
#   SRUN_CPUS_PER_TASK every srun task gets the job's --cpus-per-task (Slurm >= 22.05 needs this)
# The scripts themselves only choose resources and a launch pattern; none names a Python script's flags.

set -euo pipefail

if [[ -z "${SLURM_JOB_ID:-}" ]]; then
    echo "error: this is a Slurm batch script: submit it with 'sbatch $0' (from the root of the course" \
         "repository), or run your training script directly outside Slurm." >&2
    exit 2
fi

COURSE_ROOT="${COURSE_ROOT:-${SLURM_SUBMIT_DIR:-$PWD}}"
export PYTHONPATH="$COURSE_ROOT/notebooks${PYTHONPATH:+:$PYTHONPATH}"
COURSE_TRAIN="$COURSE_ROOT/scripts/train.py"
TRAIN_SCRIPT="${TRAIN_SCRIPT:-$COURSE_TRAIN}"
if [[ ! -f "$TRAIN_SCRIPT" ]]; then
    echo "error: TRAIN_SCRIPT=$TRAIN_SCRIPT does not exist (relative paths start at $PWD, where sbatch ran)" >&2
    exit 2
fi
if [[ "$TRAIN_SCRIPT" -ef "$COURSE_TRAIN" ]]; then
    TRAIN_ARGS="${TRAIN_ARGS:---model resnet18 --epochs 10 --precision amp --channels-last --workers 4}"
fi
TRAIN_ARGS="${TRAIN_ARGS:-}"
# shellcheck disable=SC2034  # used by the scripts that source this file
read -r -a TRAIN_ARGV <<< "$TRAIN_ARGS"   # the flags as an array: "${TRAIN_ARGV[@]}"

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
    echo "python: $(command -v python); script: $TRAIN_SCRIPT ${TRAIN_ARGS}"
    if [[ -n "${COURSE_STAGE:-}" ]]; then
        # COURSE_STAGE=shards (or cifar10, mnist): the data set copied to each node's own disk first
        # shellcheck source=data/stage.sh
        source "$COURSE_ROOT/data/stage.sh" "$COURSE_STAGE" || exit 2
    fi
}

# The batch shell runs on the job's first node: the rendezvous is there, on a port that is free
# there now and below the ports the kernel hands to outgoing connections, so that no other process
# can be given it before rank 0 listens (slurm/lib/rendezvous_port.py). COURSE_MASTER_PORT=PORT asks
# for one; where it is taken, another is used and the log says so. (A port derived from the job id
# would collide for jobs whose ids differ by its range.)
course_rendezvous() {
    MASTER_ADDR="$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)"
    MASTER_PORT="$(python "$COURSE_ROOT/slurm/lib/rendezvous_port.py" --wanted "${COURSE_MASTER_PORT:-}")"
    export MASTER_ADDR MASTER_PORT
    echo "job $SLURM_JOB_ID on ${SLURM_JOB_NUM_NODES:-1} node(s): $SLURM_JOB_NODELIST; rendezvous $MASTER_ADDR:$MASTER_PORT"
}

# Training that outlives the time limit (#SBATCH --signal=B:USR1@t --requeue): run the command in
# the background; when Slurm's warning reaches this shell, tell the training processes to write a
# checkpoint at their next step and stop, wait for them, then requeue the job with the same id.
#   course_run_requeueable children CMD...   the signal goes to CMD's children (torchrun's workers)
#   course_run_requeueable steps CMD...      the signal goes to every task of the job's steps (srun)
#   course_run_requeueable self CMD...       the signal goes to CMD itself (Ray Tune's driver stops the search)
course_run_requeueable() {
    local forward="$1" status=0
    shift
    REQUEUE=0
    # shellcheck disable=SC2317  # called by the trap
    _course_stop_for_requeue() {
        echo "time limit near: asking training to checkpoint at its next step and stop"
        REQUEUE=1
        if [[ "$forward" == children ]]; then
            pkill -USR1 -P "$TRAIN_PID" || true
        elif [[ "$forward" == self ]]; then
            kill -USR1 "$TRAIN_PID" || true
        else
            scancel --signal=USR1 "$SLURM_JOB_ID"   # the tasks of the job's steps, not this shell
        fi
    }
    trap _course_stop_for_requeue USR1
    "$@" &
    TRAIN_PID=$!
    # A trapped signal interrupts `wait`; keep waiting while training runs, then keep its status.
    while kill -0 "$TRAIN_PID" 2>/dev/null; do
        wait "$TRAIN_PID" && status=0 || status=$?
    done
    if (( REQUEUE )); then
        # what the job script must end before Slurm ends the job (the Ray pattern's Ray): its course_before_requeue
        if declare -F course_before_requeue >/dev/null; then course_before_requeue; fi
        echo "requeueing job $SLURM_JOB_ID; it resumes from what it saved in $RUN_DIR"
        scontrol requeue "$SLURM_JOB_ID"   # the job goes back to the queue with the same id
    fi
    return "$status"
}

# Since Slurm 22.05, srun no longer inherits sbatch's --cpus-per-task: without this, every
# rank started by srun (and all its DataLoader workers) would share a single core.
if [[ -n "${SLURM_CPUS_PER_TASK:-}" ]]; then
    export SRUN_CPUS_PER_TASK="$SLURM_CPUS_PER_TASK"
fi
# Optional GPU binding for srun (COURSE_GPU_BIND=single:1 where the cluster's gres.conf records GPU
# affinity): each task then sees only its own GPU, the one nearest its cores, as its cuda:0. (closest
# shows a task every GPU of its socket: two tasks see the same two.) Every course script handles it:
# those that form their own process group compare GPU UUIDs across ranks
# (course_utils.process_group.init_distributed), Lightning and Fabric read the binding from Slurm's
# variables (course_utils.lit.plan_launch); a script that picks cuda:$LOCAL_RANK does not.
if [[ -n "${COURSE_GPU_BIND:-}" ]]; then
    export SLURM_GPU_BIND="$COURSE_GPU_BIND"
fi

COURSE_RUNS="${COURSE_RUNS:-$COURSE_ROOT/runs}"
# A folder per job, named after it; a requeued job keeps its id, so it finds what it saved. A resubmission is a new
# job: COURSE_RUN_NAME names the folder instead (a new one, or the one an earlier job wrote, e.g.
# ft3-multi-node-ray-1234), so the resubmitted job resumes from it:
#     COURSE_RUN_NAME=my-search sbatch slurm/ft3/multi_node_ray.sbatch   (or sbatch --export=ALL,COURSE_RUN_NAME=...)
# A name, not RUN_DIR itself: every job exports RUN_DIR, and a job submitted from inside a job would inherit it.
if [[ "${COURSE_RUN_NAME:-}" == */* ]]; then
    echo "error: COURSE_RUN_NAME=$COURSE_RUN_NAME is a folder name under COURSE_RUNS=$COURSE_RUNS, not a path:" \
         "give the name, and set COURSE_RUNS for another place" >&2
    exit 2
fi
RUN_DIR="$COURSE_RUNS/${COURSE_RUN_NAME:-${SLURM_JOB_NAME:-job}-${SLURM_ARRAY_JOB_ID:-$SLURM_JOB_ID}}"
if ! mkdir -p "$RUN_DIR"; then   # for any script: "a folder per job" exists before it starts
    echo "error: cannot create RUN_DIR=$RUN_DIR: set COURSE_RUNS to a folder you can write on a filesystem every node sees" >&2
    exit 2
fi
export COURSE_RUNS RUN_DIR TRAIN_SCRIPT TRAIN_ARGS
