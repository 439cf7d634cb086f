"""slurm/generate.py --detect: a site file from what a cluster says (scontrol show node/partition -o, in
Slurm 22.05's format), for layouts unlike the suite's cluster; on the suite's cluster itself: test_slurm.py."""

import importlib.util
import subprocess
import sys
import tomllib

import pytest

from course_utils.paths import REPO_ROOT

_spec = importlib.util.spec_from_file_location("slurm_detect", REPO_ROOT / "slurm" / "detect.py")
detect = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(detect)

OS = "OS=Linux 6.1.0-18-amd64 #1 SMP PREEMPT_DYNAMIC Debian 6.1.76-1 (2024-02-01)"


def node(name, cpus, memory, gres, partitions):
    return (f"NodeName={name} Arch=x86_64 CoresPerSocket={cpus // 2} CPUAlloc=0 CPUEfctv={cpus} CPUTot={cpus} "
            f"CPULoad=0.01 AvailableFeatures=(null) ActiveFeatures=(null) Gres={gres} NodeAddr={name} "
            f"NodeHostName={name} Version=22.05.8 {OS} RealMemory={memory} AllocMem=0 FreeMem=N/A Sockets=2 "
            f"Boards=1 State=IDLE ThreadsPerCore=1 TmpDisk=0 Weight=1 Owner=N/A MCS_label=N/A "
            f"Partitions={partitions} BootTime=2026-11-25T08:00:00 SlurmdStartTime=2026-11-25T08:00:01 "
            f"CfgTRES=cpu={cpus},mem={memory}M,billing={cpus} AllocTRES= CapWatts=n/a CurrentWatts=0 AveWatts=0")


def partition(name, nodes, default="NO", oversubscribe="NO"):
    return (f"PartitionName={name} AllowGroups=ALL AllowAccounts=ALL AllowQos=ALL AllocNodes=ALL Default={default} "
            f"QoS=N/A DefaultTime=NONE DisableRootJobs=NO ExclusiveUser=NO GraceTime=0 Hidden=NO MaxNodes=UNLIMITED "
            f"MaxTime=2-00:00:00 MinNodes=0 LLN=NO MaxCPUsPerNode=UNLIMITED Nodes={nodes} PriorityJobFactor=1 "
            f"PriorityTier=1 RootOnly=NO ReqResv=NO OverSubscribe={oversubscribe} OverTimeLimit=NONE PreemptMode=OFF "
            f"State=UP TotalCPUs=128 TotalNodes=2 SelectTypeParameters=NONE JobDefaults=(null) DefMemPerCPU=1000 "
            f"MaxMemPerNode=UNLIMITED TRES=cpu=128,mem=500000M,node=2,billing=128,gres/gpu=8")


def test_a_line_of_scontrol_is_read_whole_values_with_spaces_and_equals_signs_included():
    (rec,) = detect.records(node("g1", 32, 190000, "gpu:v100:4(S:0-1)", "gpu,long"))
    assert rec["OS"].startswith("Linux 6.1.0") and rec["OS"].endswith("(2024-02-01)")
    assert rec["CfgTRES"] == "cpu=32,mem=190000M,billing=32" and rec["AllocTRES"] == "" and rec["CPUTot"] == "32"
    assert detect.gpus("gpu:a100:2(S:0-1),gpu:rtx:4(S:0)") == [("a100", 2), ("rtx", 4)]
    assert detect.gpus("gpu:4") == [(None, 4)] and detect.gpus("(null)") == [] and detect.gpus("mps:100") == []


def test_typed_gpus_in_a_partition_that_is_not_the_default():
    nodes = detect.records("\n".join([node("c1", 128, 500000, "(null)", "cpu"),
                                      node("g1", 32, 190000, "gpu:v100:4(S:0-1)", "gpu"),
                                      node("g2", 32, 190000, "gpu:v100:4(S:0-1)", "gpu")]))
    parts = detect.records("\n".join([partition("cpu", "c1", default="YES"), partition("gpu", "g[1-2]")]))
    site, notes = detect.site_from("hpc1", nodes, parts)
    assert (site["gpus_per_node"], site["cores_per_node"], site["mem_per_node_gb"]) == (4, 32, 185)
    assert site["gres"] == "gpu:v100" and not site["whole_nodes"] and site["sbatch"][0] == "--partition=gpu"
    assert notes == []
    text = detect.toml("hpc1", site, notes)
    assert tomllib.loads(text)["gres"] == "gpu:v100" and "SET:" in text, text


def test_whole_nodes_untyped_gpus_and_a_choice_between_partitions_noted():
    nodes = detect.records("\n".join([node("r1", 16, 1, "gpu:4", "rtx,rtx-dev"), node("r2", 16, 1, "gpu:4", "rtx,rtx-dev")]))
    parts = detect.records("\n".join([partition("rtx", "r[1-2]", oversubscribe="EXCLUSIVE"),
                                      partition("rtx-dev", "r[1-2]", oversubscribe="EXCLUSIVE")]))
    site, notes = detect.site_from("frontera", nodes, parts)
    assert site["whole_nodes"] and site["gres"] == "" and site["mem_per_node_gb"] == 0, "no --gres, no --mem"
    assert site["sbatch"][0] == "--partition=rtx" and "rtx-dev" in notes[0]
    site, _ = detect.site_from("frontera", nodes, parts, partition="rtx-dev")
    assert site["sbatch"][0] == "--partition=rtx-dev"


def test_a_cluster_without_gpus_or_a_wrong_choice_is_one_line():
    nodes = detect.records(node("c1", 128, 500000, "(null)", "cpu"))
    with pytest.raises(detect.DetectError, match="no node of this cluster lists GPUs"):
        detect.site_from("cpus", nodes, detect.records(partition("cpu", "c1", default="YES")))
    nodes = detect.records(node("g1", 64, 256000, "gpu:a100:2,gpu:rtx:4", "debug"))
    with pytest.raises(detect.DetectError, match="no GPU of type h100"):
        detect.site_from("x", nodes, detect.records(partition("debug", "g1", default="YES")), gpu_type="h100")


def test_without_scontrol_the_command_says_where_to_run_it(tmp_path):
    out = subprocess.run([sys.executable, str(REPO_ROOT / "slurm" / "generate.py"), "--detect", "mysite"],
                         capture_output=True, text=True, env={"PATH": str(tmp_path)}, cwd=tmp_path)
    assert out.returncode == 1 and "run --detect on a login node" in out.stderr and "Traceback" not in out.stderr
    assert not (REPO_ROOT / "slurm" / "sites" / "mysite.toml").exists()
