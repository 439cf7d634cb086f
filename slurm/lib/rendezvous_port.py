#!/usr/bin/env python3
"""Ports free on this node now, for a job's rendezvous (course_rendezvous) and Ray's (ray_node.sh), one a line.

    python slurm/lib/rendezvous_port.py [COUNT] [--wanted PORT]

They are drawn below the kernel's ephemeral range (net.ipv4.ip_local_port_range, 32768-60999 by default), the
range from which the kernel gives every outgoing connection its local port. A port from bind(("", 0)) lies inside
it, so any process on the node that connects anywhere may be handed it between the batch shell's choice and rank 0's
bind, and rank 0 fails with EADDRINUSE (pytorch #126510). Below that range only another listener can take it.
--wanted (the job's COURSE_MASTER_PORT) is the first choice; where something holds it, another is drawn and one line
on stderr says so. The standard library only: the batch shell runs it before anything else.
"""

from __future__ import annotations

import argparse
import random
import socket
import sys

LOWEST = 20000  # below it: other services' customary ports
RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"


def ephemeral_start(path: str = RANGE_FILE) -> int:
    """The first port the kernel hands to outgoing connections (Linux's default where the file is missing)."""
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def bindable(port: int) -> bool:
    """Whether a server could listen on ``port`` on every interface now (as rank 0's TCP store would)."""
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


def choose(count: int = 1, wanted: int | None = None, top: int | None = None, free=bindable,
           rng: random.Random | None = None) -> tuple[list[int], str | None]:
    """``count`` distinct free ports below the ephemeral range (``wanted`` first where it is free), and the note to
    print where ``wanted`` was not."""
    rng = rng or random.SystemRandom()
    top = ephemeral_start() if top is None else top
    chosen: list[int] = []
    note = None
    if wanted:
        if free(wanted):
            chosen.append(wanted)
        else:
            note = f"note: COURSE_MASTER_PORT={wanted} is in use on {socket.gethostname().split('.')[0]}: using another"
    for _ in range(1000):
        if len(chosen) == count or top - LOWEST < 1000:  # a node whose ephemeral range starts low: as bind(0) would
            break
        port = rng.randrange(LOWEST, top)
        if port not in chosen and free(port):
            chosen.append(port)
    while len(chosen) < count:
        with socket.socket() as s:
            s.bind(("", 0))
            chosen.append(s.getsockname()[1])
    return chosen, note


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("count", nargs="?", type=int, default=1)
    p.add_argument("--wanted", type=lambda v: int(v) if v else None, default=None,
                   help="the port to take where it is free (empty: none)")
    args = p.parse_args(argv)
    ports, note = choose(args.count, args.wanted)
    if note:
        print(note, file=sys.stderr, flush=True)
    print(*ports, sep="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
