"""The uninterrupted run a resume test compares with (test_fault_tolerance): one per rank count for the
whole session (the ``uninterrupted`` fixture in conftest.py)."""

from pathlib import Path

from course_utils.checkpoint import load_checkpoint
from course_utils.launch import run_script
from course_utils.results import parse_result

# 4 epochs of batch 32 per rank over 1536 images, on the CPU
RESUME_ARGS = ["--model", "cnn", "--epochs", "4", "--n-train", "1536", "--n-val", "64", "--batch-size", "32",
               "--workers", "0", "--no-progress"]
# bit-identical resumes need the same arithmetic: one thread per rank in every run compared
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def uninterrupted_run(ranks: int, folder: Path) -> tuple[dict, dict]:
    """RESUME_ARGS on ``ranks`` ranks, never interrupted: its final checkpoint and its RESULT."""
    run = run_script("train.py", [*RESUME_ARGS, "--ckpt-dir", folder], nproc=ranks, env=ONE_THREAD, timeout_s=900,
                     echo=False)
    return load_checkpoint(folder / "last.pt"), parse_result(run.output)
