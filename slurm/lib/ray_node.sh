#!/bin/bash
# srun runs this once per node of a Ray job (slurm/*/multi_node_ray.sbatch):
#     ray_node.sh head PORT           the head (Ray's GCS on PORT) on the job's first node
#     ray_node.sh worker HEAD:PORT    a worker on every other node, joining the head
# Ray stays in the foreground (--block): ending the step (the search's end, scancel, the job's end)
# sends this script SIGTERM, and it ends this node's Ray, and only this job's (`ray stop` would stop
# every Ray of yours on the node, another job's too), and returns once it is gone: nothing of the job
# outlives its batch script, whatever the cluster's process tracking. Once this node has joined, it
# writes $RAY_JOINED_DIR/<node>: the batch script starts the search only when every node has.
set -euo pipefail
: "${SLURM_JOB_ID:?run this under srun, inside a Slurm job}"
role="${1:?usage: ray_node.sh head PORT | worker HEAD:PORT}"
node="$(hostname -s)"
# A short, node-local folder per job and node: Ray's sockets, logs and spilled objects stay out of $HOME
temp="/tmp/ray-$SLURM_JOB_ID-$node"
# This job's Ray processes on this node are those whose command line names that folder (ray start's --temp-dir,
# the GCS server's and raylet's log folders, the monitor's)
mine="$temp( |/|\$)"
# SIGTERM (or ^C): ask them to end, give them RAY_STOP_WAIT_S, end what is left, and only then return
# shellcheck disable=SC2317  # called by the trap
stop_this_ray() {
    trap - TERM INT
    pkill -TERM -f -- "$mine" 2>/dev/null || true
    local waited=0
    while pgrep -f -- "$mine" >/dev/null && (( waited < ${RAY_STOP_WAIT_S:-3} * 4 )); do   # within KillWait
        sleep 0.25
        waited=$((waited + 1))
    done
    pkill -KILL -f -- "$mine" 2>/dev/null || true
    for _ in {1..50}; do   # SIGKILL is not refused: gone in moments
        if ! pgrep -f -- "$mine" >/dev/null; then break; fi
        sleep 0.1
    done
    exit 143
}
trap stop_this_ray TERM INT
# Ports free here now, for everything Ray would otherwise give a fixed default (another job's Ray on the
# node would collide: the agent's 52365, the client server's 10001) or make its raylet wait for
# (below the ports the kernel hands to outgoing connections: slurm/lib/rendezvous_port.py)
mapfile -t port < <(python "$(dirname "${BASH_SOURCE[0]}")/rendezvous_port.py" 5)
# Ray 2.60's raylet gives the dashboard agent it starts 15 s, hard-coded, to write the file naming its HTTP port
# (dashboard_agent_listen_port_<node id>), and aborts the node when the file is late ("Timed out waiting for file" in
# NodeManager::WaitForDashboardAgentPorts: ray issue #65983); `ray start` says only "The current node timed out during
# startup", some seconds later. The agent is a new Python process: its first import on a node with the environment on
# a shared filesystem (Lustre: Frontera's $WORK, FT3's $STORE), or any start on a node busy with other jobs, can take
# longer. So: the agent's other ports are given (the raylet then waits for that one file only), the runtime-env agent
# gets 5 minutes (a setting, unlike the 15 s), the agents' imports are read once before Ray starts, and a start that
# still fails is tried again after a wait that doubles (5 s, 10 s, ... at most 60 s), for as long as RAY_START_TIMEOUT
# (seconds since this step began, default 600) allows: a busy spell passes, and each try finds more files cached.
export RAY_agent_register_timeout_ms="${RAY_agent_register_timeout_ms:-300000}"
# A task or trial given no GPU sees none, in any Ray script (Ray 2.60 would leave it this node's CUDA_VISIBLE_DEVICES:
# it would take GPU 0 beside the trials given GPUs; ray issue #54868)
export RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO=1
args=(--block --temp-dir "$temp" --num-cpus "${SLURM_CPUS_PER_TASK:-1}" --disable-usage-stats
      --node-ip-address "$(python -c 'import socket; print(socket.gethostbyname(socket.gethostname()))')"
      --dashboard-agent-listen-port "${port[0]}" --dashboard-agent-grpc-port "${port[1]}"
      --metrics-export-port "${port[2]}" --runtime-env-agent-port "${port[3]}")
if [[ -n "${SLURM_GPUS_ON_NODE:-}" ]]; then
    args+=(--num-gpus "$SLURM_GPUS_ON_NODE")   # what Slurm gave this node, not what Ray would probe for
fi
case "$role" in
    head)   args+=(--head --port "${2:?the port of the head}" --include-dashboard=false
                   --ray-client-server-port "${port[4]}") ;;
    worker) args+=(--address "${2:?the address of the head, HOST:PORT}") ;;
    *)      echo "error: ray_node.sh head PORT | worker HEAD:PORT, not '$role'" >&2; exit 2 ;;
esac
python - <<'WARM' 2>/dev/null || true
import logging
logging.disable(logging.CRITICAL)
import ray._private.runtime_env.agent.main  # noqa: F401  the runtime-env agent
import ray.dashboard.agent  # noqa: F401  the dashboard agent, and the modules it loads
from ray.dashboard import utils
utils.get_all_modules(utils.DashboardAgentModule)
WARM
joined="${RAY_JOINED_DIR:-}/$node"
if [[ "$role" == worker && -n "${RAY_JOINED_DIR:-}" ]]; then
    # started beside the head, so the imports above were read on every node at once: now join a head that is up
    until [[ -n "$(find "$RAY_JOINED_DIR" -mindepth 1 -print -quit)" ]]; do sleep 0.5; done
fi
RAY_START_TIMEOUT="${RAY_START_TIMEOUT:-600}"
deadline=$((SECONDS + RAY_START_TIMEOUT))   # the same for the workers, whose wait for the head counts too
wait_s="${RAY_START_BACKOFF_S:-5}"
log="$temp/session_latest/logs/raylet.out"
for attempt in {1..100}; do   # the deadline ends the tries long before the hundredth
    echo "ray $role on $node (try $attempt, for up to ${RAY_START_TIMEOUT} s in all); temporary files in $temp"
    started=0
    # ray start prints "Ray runtime started" once this node has registered with the head, then blocks
    while IFS= read -r line; do
        echo "$line"
        if (( ! started )) && [[ "$line" == *"Ray runtime started"* ]]; then
            started=1
            if [[ -n "${RAY_JOINED_DIR:-}" ]]; then touch "$joined"; fi
        fi
    done < <(ray start "${args[@]}" 2>&1)
    if (( started )); then
        exit 1   # a running Ray ended by itself: the lines above say why
    fi
    # the raylet's fatal line says what failed (ray start's own message does not): from "Check failed:" on
    fatal="$(grep -h -m1 ' C ' "$log" 2>/dev/null | sed -e 's/.*Check failed: [^ ]* //' | cut -c1-200 || true)"
    if (( SECONDS + wait_s > deadline )); then
        break
    fi
    echo "ray $role on $node: try $attempt failed${fatal:+ ($fatal)}; next try in $wait_s s"
    sleep "$wait_s" & wait $!   # a wait the trap interrupts (a foreground sleep would hold it off)
    wait_s=$((wait_s * 2 < 60 ? wait_s * 2 : 60))
done
echo "error: Ray's $role on $node did not start in $attempt tries over $SECONDS s (RAY_START_TIMEOUT=$RAY_START_TIMEOUT);" \
     "its log: $log on $node${fatal:+ (first fatal line: $fatal)}. If the agent was late (\"Timed out waiting for" \
     "file\"), the node is slow to start Python: raise RAY_START_TIMEOUT, or put the environment on node-local disk" >&2
exit 1
