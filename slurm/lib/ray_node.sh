#!/bin/bash
# srun runs this once per node of a Ray job (slurm/*/multi_node_ray.sbatch):
#     ray_node.sh head PORT           the head (Ray's GCS on PORT) on the job's first node
#     ray_node.sh worker HEAD:PORT    a worker on every other node, joining the head
# Ray stays in the foreground (--block): Slurm owns its processes, and ending the step (scancel, the
# job's end) ends this node's Ray, and only this job's. (`ray stop` would stop every Ray of yours on
# the node, another job's too.)
set -euo pipefail
: "${SLURM_JOB_ID:?run this under srun, inside a Slurm job}"
role="${1:?usage: ray_node.sh head PORT | worker HEAD:PORT}"
node="$(hostname -s)"
# A short, node-local folder per job and node: Ray's sockets, logs and spilled objects stay out of $HOME
temp="/tmp/ray-$SLURM_JOB_ID-$node"
free_port() { python -c 'import socket; s = socket.socket(); s.bind(("", 0)); print(s.getsockname()[1])'; }
# Ray's fixed default ports (the agent's 52365, the client server's 10001) would collide with
# another job's Ray on the same node: take ports free here now.
args=(--block --temp-dir "$temp" --num-cpus "${SLURM_CPUS_PER_TASK:-1}" --disable-usage-stats
      --node-ip-address "$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
      --dashboard-agent-listen-port "$(free_port)")
case "$role" in
    head)   args+=(--head --port "${2:?the port of the head}" --include-dashboard=false
                   --ray-client-server-port "$(free_port)") ;;
    worker) args+=(--address "${2:?the address of the head, HOST:PORT}") ;;
    *)      echo "error: ray_node.sh head PORT | worker HEAD:PORT, not '$role'" >&2; exit 2 ;;
esac
echo "ray $role on $node; temporary files in $temp"
exec ray start "${args[@]}"
