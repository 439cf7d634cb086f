"""A cold shared filesystem, for the Ray pattern's test: on PYTHONPATH, this makes the first import of
Ray's dashboard agent on each node of a Slurm job take COURSE_SLOW_IMPORT_S seconds (default 17), as
the first read of its modules from Lustre can; later imports on that node are fast, as from a cache.
Ray 2.60's raylet gives the agent 15 s to report its ports, so a node that starts Ray cold fails."""

import importlib.abc
import os
import socket
import sys
import time
from pathlib import Path

SLOW = "ray.dashboard.agent"


class ColdFirstImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == SLOW:
            mark = Path(f"/tmp/cold-imports-{os.environ.get('SLURM_JOB_ID', 'none')}-{socket.gethostname()}")
            if not mark.exists():
                time.sleep(float(os.environ.get("COURSE_SLOW_IMPORT_S", "17")))
                mark.touch()
        return None  # the usual finders import it


sys.meta_path.insert(0, ColdFirstImport())
