"""A site file written from what a Slurm cluster says about itself (``python slurm/generate.py --detect NAME``,
on a login node): its GPU partition, GPUs per node and how they are asked for, CPUs and memory per node,
whether jobs get whole nodes. What the cluster cannot say (modules to load, the environment, an account,
where to write) is left in the file, marked, with what to put there. The standard library only."""

from __future__ import annotations

import re
import subprocess
from collections import Counter
from datetime import date

# Key=Value pairs of `scontrol show ... -o`: a value runs to the next " Key=" (values may hold spaces)
PAIR = re.compile(r"(?:^|\s)([A-Za-z][\w/:]*)=(.*?)(?=\s+[A-Za-z][\w/:]*=|\s*$)")


class DetectError(RuntimeError):
    pass


def records(text: str) -> list[dict[str, str]]:
    """The records of `scontrol show node|partition -o`, one a line."""
    return [dict(PAIR.findall(line.strip())) for line in text.splitlines() if "=" in line]


def gpus(gres: str) -> list[tuple[str | None, int]]:
    """(type or None, count) of each GPU entry of a node's Gres: "gpu:a100:2(S:0-1),gpu:rtx:4" ->
    [("a100", 2), ("rtx", 4)]; "gpu:4" -> [(None, 4)]; "(null)" -> []."""
    found = []
    for entry in re.sub(r"\([^)]*\)", "", gres or "").split(","):
        parts = entry.strip().split(":")
        if parts[0] != "gpu" or len(parts) < 2 or not parts[-1].isdigit():
            continue
        found.append((parts[1] if len(parts) == 3 else None, int(parts[-1])))
    return found


def site_from(cluster: str, nodes: list[dict[str, str]], partitions: list[dict[str, str]],
              partition: str | None = None, gpu_type: str | None = None) -> tuple[dict, list[str]]:
    """The site's facts (the keys of slurm/sites/*.toml the cluster can tell) and notes on the choices made."""
    notes = []
    with_gpus = [n for n in nodes if gpus(n.get("Gres", ""))]
    if not with_gpus:
        raise DetectError("no node of this cluster lists GPUs in its Gres: the course's patterns ask for GPUs "
                          "(write slurm/sites/NAME.toml by hand from generic.toml)")
    gpu_partitions = [p["PartitionName"] for p in partitions
                      if any(p["PartitionName"] in n.get("Partitions", "").split(",") for n in with_gpus)]
    if partition is None:
        defaults = [p["PartitionName"] for p in partitions
                    if p.get("Default") == "YES" and p["PartitionName"] in gpu_partitions]
        partition = (defaults or gpu_partitions)[0]
        others = [p for p in gpu_partitions if p != partition]
        if others:
            notes.append(f"partition {partition} chosen; GPU nodes are also in {', '.join(others)} "
                         "(--partition NAME chooses another)")
    elif partition not in gpu_partitions:
        raise DetectError(f"partition {partition} has no GPU node; those with GPUs: {', '.join(gpu_partitions)}")
    part = next(p for p in partitions if p["PartitionName"] == partition)
    members = [n for n in with_gpus if partition in n.get("Partitions", "").split(",")]
    shapes = Counter((int(n["CPUTot"]), int(n.get("RealMemory", "0")), n["Gres"]) for n in members)
    (cpus, memory_mb, gres), count = shapes.most_common(1)[0]
    if len(shapes) > 1:
        notes.append(f"{count} of the partition's {len(members)} nodes have {cpus} CPUs and {gres}: the scripts ask "
                     "for that kind; the others differ")
    entries = gpus(gres)
    types = [t for t, _ in entries]
    if gpu_type is not None:
        if gpu_type not in types:
            raise DetectError(f"the nodes of {partition} have no GPU of type {gpu_type} ({gres}): choose "
                              f"--gpu-type {' or '.join(t for t in types if t) or 'nothing (untyped GPUs)'}")
        chosen = next(e for e in entries if e[0] == gpu_type)
    else:
        chosen = entries[0]
        if len(entries) > 1:
            notes.append(f"the nodes hold {gres}: {chosen[0]} chosen (--gpu-type TYPE chooses another)")
    kind, per_node = chosen
    whole = part.get("OverSubscribe", "").startswith("EXCLUSIVE")
    about = (f"{cluster}, partition {partition}: {per_node} {kind + ' ' if kind else ''}GPUs and {cpus} CPUs per node"
             f"{', whole nodes' if whole else ''} (written by slurm/generate.py --detect, {date.today().isoformat()}).")
    return ({
        "about": about,
        "gpus_per_node": per_node,
        "cores_per_node": cpus,
        # RealMemory is what Slurm lets jobs have; 1 means nobody set it: then no --mem at all
        "mem_per_node_gb": memory_mb // 1024 if memory_mb > 1024 else 0,
        "gres": "" if whole else (f"gpu:{kind}" if kind else "gpu"),
        "whole_nodes": whole,
        "sbatch": [f"--partition={partition}",
                   "#--account=PROJECT       # your allocation, where you have several (sbatch -A)"],
    }, notes)


SETTINGS = '''
# Not told by the cluster: set these (or export them before sbatch).
COURSE_MODULES="${COURSE_MODULES-}"        # SET: modules to load first (module load ...), if your site uses them
COURSE_CONDA_ENV="${COURSE_CONDA_ENV-}"    # SET: a conda env to activate; empty: the project's .venv (make setup)
COURSE_RUNS="${COURSE_RUNS:-${SLURM_SUBMIT_DIR:-.}/runs/course-runs}"  # SET: a folder every node sees (scratch)
'''


def toml(name: str, site: dict, notes: list[str]) -> str:
    """The text of slurm/sites/NAME.toml."""
    lines = [f"# {name}: detected from the cluster (scontrol show node/partition/config)."]
    lines += [f"# note: {note}" for note in notes]
    lines += [f'about = "{site["about"]}"',
              f"gpus_per_node = {site['gpus_per_node']}",
              f"cores_per_node = {site['cores_per_node']}",
              f"mem_per_node_gb = {site['mem_per_node_gb']}",
              f'gres = "{site["gres"]}"' + ("" if site["gres"] else "            # whole nodes: no --gres"),
              f"whole_nodes = {'true' if site['whole_nodes'] else 'false'}",
              "sbatch = [" + ", ".join(f'"{line}"' for line in site["sbatch"]) + "]",
              f"settings = '''{SETTINGS}'''"]
    return "\n".join(lines) + "\n"


def ask_cluster(run=subprocess.run) -> tuple[str, list[dict[str, str]], list[dict[str, str]]]:
    """(cluster name, node records, partition records) from this login node's Slurm."""
    def scontrol(*args: str) -> str:
        try:
            out = run(["scontrol", *args], capture_output=True, text=True, timeout=60)
        except FileNotFoundError:
            raise DetectError("scontrol is not here: run --detect on a login node of the cluster") from None
        if out.returncode != 0:
            raise DetectError(f"scontrol {' '.join(args)} failed: {out.stderr.strip()}")
        return out.stdout

    config = scontrol("show", "config")
    name = re.search(r"^ClusterName\s*=\s*(\S+)", config, re.M)
    return (name.group(1) if name else "this cluster", records(scontrol("show", "node", "-o")),
            records(scontrol("show", "partition", "-o")))
