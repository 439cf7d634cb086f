#!/bin/bash
# srun runs this once per task, in front of the training command. It sets the variables torchrun
# sets (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT) from Slurm's,
# so any script written for torchrun (init_process_group from the environment) runs unchanged:
#     srun slurm/lib/torch_env.sh python my_train.py
# The one place Slurm's task variables become torchrun's: every srun pattern of the course starts its tasks
# through it (course_utils.process_group.detect_env reads Slurm's own only as a fallback, for an srun without it;
# Lightning reads them itself, lit.plan_launch checks what it will see).
set -euo pipefail
: "${SLURM_PROCID:?run this under srun, inside a Slurm job}"
: "${MASTER_ADDR:?MASTER_ADDR is not set: call course_rendezvous (slurm/lib/course_job.sh) before srun}"
: "${MASTER_PORT:?MASTER_PORT is not set: call course_rendezvous (slurm/lib/course_job.sh) before srun}"
export RANK="$SLURM_PROCID" LOCAL_RANK="$SLURM_LOCALID" WORLD_SIZE="${SLURM_STEP_NUM_TASKS:-$SLURM_NTASKS}"
# Tasks on each node of the step, e.g. "2(x3),1" -> 2 2 2 1; this node's entry is LOCAL_WORLD_SIZE.
per_node=()
IFS=, read -r -a groups <<< "${SLURM_STEP_TASKS_PER_NODE:-$WORLD_SIZE}"
for group in "${groups[@]}"; do
    if [[ $group =~ ^([0-9]+)\(x([0-9]+)\)$ ]]; then
        for (( i = 0; i < BASH_REMATCH[2]; i++ )); do per_node+=("${BASH_REMATCH[1]}"); done
    else
        per_node+=("$group")
    fi
done
export LOCAL_WORLD_SIZE="${per_node[${SLURM_NODEID:-0}]:-1}"
exec "$@"
