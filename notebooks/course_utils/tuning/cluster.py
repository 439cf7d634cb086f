"""Ray itself: join the cluster RAY_ADDRESS names or start one here, with short temporary folders and token
authentication; wait until every node of a Slurm job has joined."""

from __future__ import annotations

import getpass
import logging
import os
import secrets
import socket


def ray_temp_dir() -> str:
    """A short, node-local folder for Ray's sessions, sockets and logs: per job under Slurm, else per user."""
    job = os.environ.get("SLURM_JOB_ID")  # slurm/lib/ray_node.sh names it the same way
    return f"/tmp/ray-{job}-{socket.gethostname().split('.')[0]}" if job else f"/tmp/ray-{getpass.getuser()}"


def auth_env() -> dict[str, str]:
    """Token authentication with a fresh token, unless ``RAY_AUTH_MODE`` is already set.

    Ray's processes listen on the node's network: on a shared node (a login node, a
    JupyterLab job on a node other jobs share) anyone who reaches the port could run code
    as you. The token lives in the environment of this process and its children only,
    not in a file in your home folder.
    """
    if "RAY_AUTH_MODE" in os.environ:
        return {}
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}


# Every task, trial and Ray Train worker of the course's searches: one given no GPU sees none. Ray 2.60 leaves such a
# process the node's CUDA_VISIBLE_DEVICES (ray issue #54868), so a CPU trial would train on GPU 0 beside the GPU trials.
TRIAL_ENV = {"RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO": "1"}


def start_ray(address: str | None = None, num_cpus: int | None = None, num_gpus: int | None = None,
              quiet: bool = True) -> dict[str, float]:
    """Join the Ray cluster at ``address`` (or ``$RAY_ADDRESS``), or start one here; its resources.

    ``quiet``: the trials' own output stays in their log files, not in this cell or terminal.
    """
    import sys

    from ..hardware import usable_cores

    # Tune snapshots its state whenever a trial replaces its one kept checkpoint; cheap here, so no warning
    os.environ.setdefault("TUNE_WARN_EXCESSIVE_EXPERIMENT_CHECKPOINT_SYNC_THRESHOLD_S", "0")
    imported = "ray" in sys.modules
    token = auth_env()
    os.environ.update(token)  # the processes Ray starts inherit it
    import ray

    if imported and token:  # Ray read the mode when it was imported: have it read it again, as Ray itself does
        from ray._private.authentication.authentication_token_setup import _enable_token_auth

        _enable_token_auth()

    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            why = unreachable(address)
            if why:
                raise ConnectionError(why)
            ray.init(address=address, log_to_driver=not quiet, runtime_env={"env_vars": TRIAL_ENV})
        else:
            ray.init(num_cpus=num_cpus or usable_cores(), num_gpus=num_gpus, include_dashboard=False,
                     _temp_dir=ray_temp_dir(), log_to_driver=not quiet, runtime_env={"env_vars": TRIAL_ENV},
                     logging_level=logging.WARNING if quiet else logging.INFO)  # not "Started a local Ray instance"
    return {k: v for k, v in ray.cluster_resources().items() if k in ("CPU", "GPU", "memory")}


def unreachable(address: str, timeout_s: float = 5.0) -> str | None:
    """Why no Ray can be listening at ``address`` (HOST:PORT), or None. Checked in seconds: ``ray.init``
    itself retries a silent address for minutes before it gives up with a stack of tracebacks."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return None  # "auto", ray://...: Ray's own forms, left to Ray
    try:
        socket.create_connection((host, int(port)), timeout=timeout_s).close()
    except OSError as exc:
        return (f"no Ray is listening at {address} ({exc.strerror or exc}): start one there (ray start --head "
                f"--port {port}), or leave out --address and RAY_ADDRESS to start Ray on this machine")
    return None


def wait_for_nodes(count: int, timeout_s: float = 120.0) -> list[str]:
    """Wait until ``count`` nodes have joined the cluster; their addresses. Names the missing ones on timeout."""
    import ray

    from ..waiting import wait_until

    def alive() -> list[str]:
        return sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])

    wait_until(lambda: len(alive()) >= count, timeout_s, interval_s=1.0, on_timeout=lambda: TimeoutError(
        f"only {len(alive())} of {count} Ray nodes joined within {timeout_s:.0f} s "
        f"({', '.join(alive()) or 'none'}): see the workers' lines in the job log"))
    return alive()


