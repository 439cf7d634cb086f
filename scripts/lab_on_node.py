#!/usr/bin/env python
"""JupyterLab on a compute node, reachable only through your own SSH tunnel.

Run it inside a job (salloc, idev, or an interactive srun) on the node that
should run the notebooks::

    python scripts/lab_on_node.py --login ft3.cesga.es          # FT3
    python scripts/lab_on_node.py --login frontera.tacc.utexas.edu

It takes a port that is free on this node now (thirty learners on one shared
node must not all ask for 8888), binds JupyterLab to 127.0.0.1 so that nobody
else on the cluster's network can reach it, keeps Jupyter's token, and prints
the one ``ssh -L`` line to run on your laptop. ``--dry-run`` prints the plan
without starting JupyterLab.
"""

from __future__ import annotations

import argparse
import getpass
import os
import socket
import sys

from course_utils.process_group import free_port
from course_utils.paths import REPO_ROOT


def plan(login: str, user: str, host: str, port: int) -> tuple[list[str], str]:
    """The JupyterLab command for this node, and the tunnel line for the laptop."""
    command = [sys.executable, "-m", "jupyter", "lab", "--no-browser", "--ip=127.0.0.1", f"--port={port}",
               f"--ServerApp.root_dir={REPO_ROOT}", "--ServerApp.port_retries=0"]
    # -J hops through the login node to this compute node; the port is forwarded to its loopback
    tunnel = f"ssh -N -L {port}:127.0.0.1:{port} -J {user}@{login} {user}@{host}"
    return command, tunnel


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--login", default="LOGIN_NODE", help="the cluster's login node, as you ssh to it")
    p.add_argument("--user", default=getpass.getuser(), help="your user name there (default: this one)")
    p.add_argument("--dry-run", action="store_true", help="print the plan, start nothing")
    args = p.parse_args(argv)
    if not os.environ.get("SLURM_JOB_ID"):
        print("note: no SLURM_JOB_ID here: this looks like a login node, where notebooks must not train. "
              "Get a compute node first (FT3: salloc --gres=gpu:a100:1 -t 1:00:00; Frontera: idev -p rtx-dev).",
              file=sys.stderr)
    host, port = socket.gethostname(), free_port()
    command, tunnel = plan(args.login, args.user, host, port)
    print(f"JupyterLab on {host}, port {port}, reachable only through your tunnel.\n"
          f"On your laptop:\n    {tunnel}\n"
          "then open the http://127.0.0.1:PORT/lab?token=... URL that JupyterLab prints below.", flush=True)
    if args.dry_run:
        print("command: " + " ".join(command))
        return 0
    os.execv(command[0], command)  # JupyterLab replaces this process: Ctrl-C stops it


if __name__ == "__main__":
    sys.exit(main())
