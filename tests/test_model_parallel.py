"""Tensor parallelism's sharded checkpoints (scripts/train_tp.py --ckpt-dir). Notebook 09 runs the
pipeline, tensor-parallel, 2-D and RPC scripts and checks what they teach; the test Slurm cluster runs
the 2-D pattern (tests/test_slurm.py). What no notebook shows: stopping a tensor-parallel run and resuming it."""

from course_utils.launch import run_script
from course_utils.results import parse_result

TINY = ["--hidden", "32", "--heads", "2", "--blocks", "1", "--batch", "2", "--seq", "8", "--tp-size", "2",
        "--device", "cpu"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _run(*args):
    return parse_result(run_script("train_tp.py", [*TINY, *args], nproc=2, env=ONE_THREAD, timeout_s=180,
                                   echo=False).output)


def test_a_tensor_parallel_run_resumed_from_its_sharded_checkpoint_ends_where_an_unstopped_run_ends(tmp_path):
    """Two tensor-parallel ranks, SGD with momentum: each rank writes its own shards of the weights and
    of the momentum (torch.distributed.checkpoint) after step 2; the next run reads them and trains
    steps 3 and 4 with exactly the losses of a run that never stopped."""
    straight = _run("--steps", "4")
    first = _run("--steps", "2", "--ckpt-dir", str(tmp_path))
    second = _run("--steps", "4", "--ckpt-dir", str(tmp_path))
    assert (tmp_path / "latest").read_text() == "step-4" and not (tmp_path / "step-2").exists()
    assert first["resumed_from"] is None and second["resumed_from"] == 2
    assert first["losses"] + second["losses"] == straight["losses"], (first, second, straight)
    assert second["train_loss_gap"] <= 1e-5, "the unsplit blocks, checkpointed beside, still agree"
