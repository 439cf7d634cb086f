"""Launcher-agnostic rank detection: torchrun, srun, mpirun, none."""

import pytest
import torch

from course_utils import process_group as cdist


@pytest.mark.parametrize(
    "hostlist, expected",
    [
        ("node001", ["node001"]),
        ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
        ("gpu-a[01-02],login1", ["gpu-a01", "gpu-a02", "login1"]),
        ("c[098-101]", ["c098", "c099", "c100", "c101"]),
        ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),
        ("a1,b[7],c[2-3]", ["a1", "b7", "c2", "c3"]),
        ("c123-[001-002]", ["c123-001", "c123-002"]),
    ],
)
def test_expand_hostlist(hostlist, expected):
    assert cdist.expand_hostlist(hostlist) == expected


@pytest.mark.parametrize("bad", ["n[1-3", "n[5-2]", "n[a-b]"])
def test_expand_hostlist_rejects_malformed(bad):
    with pytest.raises(ValueError):
        cdist.expand_hostlist(bad)


def test_no_launcher_is_world_of_one():
    env = cdist.detect_env({})
    assert (env.rank, env.world_size, env.launcher, env.is_distributed) == (0, 1, "none", False)


def test_torchrun_env():
    env = cdist.detect_env(
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4",
         "MASTER_ADDR": "n7", "MASTER_PORT": "31000"}
    )
    assert env == cdist.DistEnv(5, 1, 8, 4, "n7", 31000, "torchrun")


def test_srun_one_task_per_gpu():
    env = cdist.detect_env(
        {"SLURM_PROCID": "3", "SLURM_LOCALID": "1", "SLURM_STEP_NUM_TASKS": "4",
         "SLURM_NTASKS": "4", "SLURM_STEP_NUM_NODES": "2",
         "SLURM_STEP_NODELIST": "gpu-a[01-02],login1", "SLURM_JOB_ID": "123456"}
    )
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (3, 1, 4, 2)
    assert env.master_addr == "gpu-a01"
    assert env.master_port == cdist.port_from_job_id(123456)


def test_slurm_explicit_master_wins():
    env = cdist.detect_env(
        {"SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
         "MASTER_ADDR": "10.0.0.9", "MASTER_PORT": "24000", "SLURM_JOB_ID": "7"}
    )
    assert (env.master_addr, env.master_port) == ("10.0.0.9", 24000)


def test_batch_step_without_srun_is_one_process():
    # `python train.py` directly in an sbatch script with --ntasks=4: one process, not four
    env = cdist.detect_env({"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_NODELIST": "n[1-2]"})
    assert env.world_size == 1 and env.launcher == "none"


def test_srun_torchrun_prefers_torchrun():
    env = cdist.detect_env(
        {"SLURM_PROCID": "1", "SLURM_STEP_NUM_TASKS": "2", "SLURM_JOB_NODELIST": "n[1-2]",
         "RANK": "6", "WORLD_SIZE": "8", "LOCAL_RANK": "2", "MASTER_ADDR": "n1", "MASTER_PORT": "29999"}
    )
    assert (env.launcher, env.rank, env.world_size, env.local_rank) == ("torchrun", 6, 8, 2)


def test_openmpi_env_wins_over_batch_slurm():
    env = cdist.detect_env(
        {"OMPI_COMM_WORLD_RANK": "2", "OMPI_COMM_WORLD_SIZE": "4",
         "OMPI_COMM_WORLD_LOCAL_RANK": "0", "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
         "SLURM_PROCID": "0", "SLURM_STEP_NUM_TASKS": "1", "MASTER_ADDR": "n1"}
    )
    assert (env.launcher, env.rank, env.world_size, env.local_world_size) == ("mpi", 2, 4, 2)


def test_bad_integer_names_the_variable():
    with pytest.raises(ValueError, match="WORLD_SIZE"):
        cdist.detect_env({"RANK": "0", "WORLD_SIZE": "four"})


def test_job_ports_differ_and_stay_in_range():
    ports = {cdist.port_from_job_id(j) for j in range(1000, 1100)}
    assert len(ports) == 100
    assert all(20000 <= p < 40000 for p in ports)


def test_cuda_without_gpu_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(RuntimeError, match="no CUDA GPU is visible"):
        cdist.choose_device("cuda")
    assert cdist.choose_device("auto").type == "cpu"
    with pytest.raises(ValueError):
        cdist.choose_device("tpu")


def test_helpers_without_process_group(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK"):
        monkeypatch.delenv(var, raising=False)
    info, device = cdist.init_distributed("cpu")
    assert not cdist.is_initialized()
    assert (cdist.get_rank(), cdist.get_world_size(), cdist.is_main_process()) == (0, 1, True)
    assert device == torch.device("cpu") and info.world_size == 1
    cdist.barrier()  # a no-op, not a hang
    cdist.cleanup()
