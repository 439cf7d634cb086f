#!/usr/bin/env python
"""Write slurm/<site>/<pattern>.sbatch from one template per launch pattern and one file per site.

    slurm/templates/<pattern>.sbatch.in   how a job launches (the same on every cluster)
    slurm/sites/<site>.toml               what a cluster has and how it is asked for it

The generated scripts are committed and read on their own: a learner opens
one file, not this program. tests/test_slurm.py fails when a committed
script differs from what this writes, so edit a template or a site file and
rerun it:

    python slurm/generate.py           # rewrite the scripts
    python slurm/generate.py --check   # exit 1 if any is out of date
    python slurm/generate.py --detect NAME [--partition P] [--gpu-type T]
                                       # on a login node: write sites/NAME.toml from what the cluster
                                       # says about itself (slurm/detect.py), then the scripts
"""

from __future__ import annotations

import math
import re
import sys
import tomllib
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEP_TRIALS = 4  # entries of SWEEP in templates/sweep_array.sbatch
TIME = "00:30:00"

PROLOGUE = """\
: "${SLURM_JOB_ID:?this is a batch script: submit it with sbatch from the root of the course repository}"
COURSE_ROOT="${COURSE_ROOT:-$SLURM_SUBMIT_DIR}"
if [[ ! -f "$COURSE_ROOT/slurm/lib/course_job.sh" ]]; then
    echo "error: $COURSE_ROOT is not the course repository: submit from its root, or set COURSE_ROOT" >&2
    exit 2
fi
# shellcheck source=slurm/lib/course_job.sh
source "$COURSE_ROOT/slurm/lib/course_job.sh"
course_activate"""


# Patterns written for one course script (its TRAIN_SCRIPT unless told otherwise). Lightning's and
# DeepSpeed's launch line is multi_node_srun's; Ray's starts Ray on every node, then its script once.
SCRIPT_OF_PATTERN = {"multi_node_2d": "scripts/train_tp.py", "multi_node_lightning": "scripts/train_lightning.py",
                     "multi_node_deepspeed": "scripts/train_deepspeed.py",
                     "multi_node_ray": "scripts/tune.py"}

OWN_SCRIPT = {"multi_node_ray": "a Ray script: ray.init() joins the job's Ray at $RAY_ADDRESS"}


def sites() -> dict[str, dict]:
    return {p.stem: tomllib.loads(p.read_text()) for p in sorted((HERE / "sites").glob("*.toml"))}


def patterns() -> list[str]:
    return sorted(p.name.removesuffix(".sbatch.in") for p in (HERE / "templates").glob("*.sbatch.in"))


def trials_per_task(site: dict) -> int:
    """A sweep's trials per array task: one per GPU where the site gives whole nodes, else one."""
    return site["gpus_per_node"] if site["whole_nodes"] else 1


def resources(site: dict, pattern: str) -> list[str]:
    """The #SBATCH resource lines of ``pattern`` on ``site``."""
    gpus, cores, mem = site["gpus_per_node"], site["cores_per_node"], site["mem_per_node_gb"]
    nodes, tasks, cpus, node_gpus, node_mem = 1, 1, cores, gpus, mem
    if pattern.startswith("multi_node"):
        nodes = 2
    if pattern in ("multi_node_srun", "multi_node_lightning", "multi_node_deepspeed", "multi_node_2d"):
        tasks, cpus = gpus, cores // gpus  # a task per GPU, each with its share of the cores
    if pattern == "sweep_array" and not site["whole_nodes"]:
        cpus, node_gpus, node_mem = cores // gpus, 1, mem // gpus  # one GPU's share of a node per trial
    lines = [f"--nodes={nodes}", f"--ntasks-per-node={tasks}", f"--cpus-per-task={cpus}"]
    if site["gres"]:
        lines.append(f"--gres={site['gres']}:{node_gpus}")
    if node_mem:
        lines.append(f"--mem={node_mem}G")
    return lines


def sbatch_lines(site_name: str, site: dict, pattern: str) -> str:
    lines = [f"--job-name={site_name}-{pattern.replace('_', '-')}", *resources(site, pattern), *site["sbatch"]]
    if pattern == "sweep_array":
        tasks = math.ceil(SWEEP_TRIALS / trials_per_task(site))
        lines += [f"--time={TIME}", f"--array=0-{tasks - 1}", "--output=logs/%x-%A_%a.out"]
    elif pattern == "multi_node_lightning":
        lines += ["--time=02:00:00", "--output=logs/%x-%j.out", "--signal=B:USR1@90", "--requeue",
                  "--open-mode=append"]
    elif pattern in ("requeue", "multi_node_ray"):
        lines += ["--time=02:00:00", "--output=logs/%x-%j.out", "--signal=B:USR1@120", "--requeue",
                  "--open-mode=append"]
    else:
        lines += [f"--time={TIME}", "--output=logs/%x-%j.out"]
    # "#--x" in a site file is an example left commented out: "##SBATCH --x"
    return "\n".join(f"##SBATCH {line[1:]}" if line.startswith("#") else f"#SBATCH {line}" for line in lines)


def render(site_name: str, site: dict, pattern: str) -> str:
    path = f"slurm/{site_name}/{pattern}.sbatch"
    gpus = (f'GPUS_PER_NODE={site["gpus_per_node"]}' if site["whole_nodes"]
            else f'GPUS_PER_NODE="${{SLURM_GPUS_ON_NODE:-{site["gpus_per_node"]}}}"')
    text = (HERE / "templates" / f"{pattern}.sbatch.in").read_text()
    if "GPUS_PER_NODE" not in text:
        gpus = ""  # srun starts a task per GPU itself: nothing here counts them
    default_script = SCRIPT_OF_PATTERN.get(pattern, "scripts/train.py")
    values = {
        "header": f"# {site['about']}\n"
                  f"# GENERATED by slurm/generate.py from slurm/templates/{pattern}.sbatch.in and "
                  f"slurm/sites/{site_name}.toml:\n# edit those and rerun it, rather than this file.",
        "usage": f"# Submit from the root of the course repository:  sbatch {path}\n"
                 f"# Your own script ({OWN_SCRIPT.get(pattern, 'one written for torchrun')}) instead of the course's "
                 f"{default_script}:\n"
                 f"#   TRAIN_SCRIPT=path/to/train.py TRAIN_ARGS=\"--epochs 5\" sbatch {path}",
        "sbatch": sbatch_lines(site_name, site, pattern),
        "settings": "# --- change these for your project (or export them before sbatch) -------------\n"
                    + site["settings"].strip() + ("\n" + gpus if gpus else "") + "\n"
                    + "# ---------------------------------------------------------------------------",
        "prologue": PROLOGUE,
        "trials_per_task": str(trials_per_task(site)),
        "packing": "whole nodes: four trials share a node" if site["whole_nodes"] else "one GPU per array task",
    }
    missing = sorted(set(re.findall(r"{{(\w+)}}", text)) - set(values))
    if missing:
        raise KeyError(f"templates/{pattern}.sbatch.in uses unknown placeholders: {missing}")
    return re.sub(r"{{(\w+)}}", lambda m: values[m.group(1)], text)


def outputs() -> dict[Path, str]:
    return {HERE / name / f"{pattern}.sbatch": render(name, site, pattern)
            for name, site in sites().items() for pattern in patterns()}


def detect_site(argv: list[str]) -> int:
    import argparse

    sys.path.insert(0, str(HERE))
    import detect

    parser = argparse.ArgumentParser(prog="python slurm/generate.py --detect")
    parser.add_argument("--detect", metavar="NAME", required=True, help="the site's name: sites/NAME.toml, NAME/*.sbatch")
    parser.add_argument("--partition", help="the GPU partition (default: the default one with GPUs, else the first)")
    parser.add_argument("--gpu-type", help="the GPU type where a node holds several")
    parser.add_argument("--force", action="store_true", help="overwrite an existing sites/NAME.toml")
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]*", args.detect):
        parser.error(f"NAME {args.detect!r}: lower-case letters, digits, - and _ (it names a folder)")
    target = HERE / "sites" / f"{args.detect}.toml"
    if target.exists() and not args.force:
        print(f"error: {target.relative_to(HERE.parent)} exists: --force overwrites it", file=sys.stderr)
        return 2
    try:
        site, notes = detect.site_from(*detect.ask_cluster(), partition=args.partition, gpu_type=args.gpu_type)
    except detect.DetectError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    target.write_text(detect.toml(args.detect, site, notes))
    for note in notes:
        print(f"note: {note}")
    print(f"wrote {target.relative_to(HERE.parent)}: {site['about']}\n"
          f"edit its lines marked SET (modules, environment, where runs go), then rerun python slurm/generate.py")
    return main([])


def main(argv: list[str]) -> int:
    if any(a == "--detect" or a.startswith("--detect=") for a in argv):
        return detect_site(argv)
    scripts = outputs()
    stale = [path for path, text in scripts.items() if not path.exists() or path.read_text() != text]
    if "--check" in argv:
        for path in stale:
            print(f"{path.relative_to(HERE.parent)} is out of date: run python slurm/generate.py", file=sys.stderr)
        return 1 if stale else 0
    for path, text in scripts.items():
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    print(f"wrote {len(scripts)} scripts ({len(stale)} changed)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
