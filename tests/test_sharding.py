"""ZeRO's theory against the paper's numbers, and what notebook 07 cannot show: a run without a launcher,
and the refusals (a resume with another batch, flags a script cannot honour). Notebook 07 measures each
stage against the theory on 2 ranks, resumes and consolidates a ZeRO-3 checkpoint, and puts FSDP2 beside
ZeRO-3: those checks live there, run once."""

import pytest

from course_utils.launch import LaunchError, run_script
from course_utils.results import parse_result
from course_utils.sharding import comm_theory, zero_theory

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_theory_reproduces_the_zero_paper():
    """Rajbhandari et al. 2020, Figure 1: 7.5 B parameters, Adam in mixed precision, 64 ranks:
    120 GB per rank without ZeRO, 31.4 GB with stage 1, 16.6 GB with stage 2, 1.9 GB with stage 3."""
    per_rank = [sum(zero_theory(7_500_000_000, 64, stage).values()) / 1e9 for stage in range(4)]
    assert [round(gb, 1) for gb in per_rank] == [120.0, 31.4, 16.6, 1.9]
    assert comm_theory(10**6, 8, 3) == pytest.approx(1.5 * comm_theory(10**6, 8, 2))
    # accumulating 4 micro-batches: stage 1 reduces once, stage 2 reduce-scatters each micro-batch, stage 3
    # also gathers the weights twice in each
    ring = 2 * 10**6 * 7 / 8  # bf16 bytes of one full pass per rank
    assert [comm_theory(10**6, 8, s, grad_accum=4) / ring for s in range(4)] == pytest.approx([2, 2, 5, 12])
    with pytest.raises(ValueError, match="stage"):
        zero_theory(10, 2, 4)


def test_one_process_without_a_launcher_and_one_line_errors(tmp_path):
    """`python scripts/train_deepspeed.py` is a group of one (DeepSpeed alone would look for MPI); its
    checkpoint refuses a resume with another per-rank batch; a flag a script cannot honour stops it
    before DeepSpeed starts, in one line; so do a folder that holds no ZeRO checkpoint and an
    offload that stage 0 cannot do."""
    tiny = ["--model", "mlp", "--epochs", "1", "--n-train", "64", "--n-val", "32", "--batch-size", "16",
            "--workers", "0", "--no-progress", "--zero-stage", "1", "--ckpt-dir", str(tmp_path)]
    result = parse_result(run_script("train_deepspeed.py", tiny, env=ONE_THREAD, timeout_s=300, echo=False).output)
    assert result["world_size"] == 1 and result["global_step"] == 4
    with pytest.raises(LaunchError) as refused:  # the per-rank batch is part of the run: not resumed
        run_script("train_deepspeed.py", [*tiny, "--epochs", "2", "--batch-size", "32"], env=ONE_THREAD,
                   timeout_s=300, echo=False)
    assert "batch_size 16 -> 32" in refused.value.result.output
    not_zero = tmp_path / "not-zero"
    not_zero.mkdir()
    (not_zero / "latest").write_text("global_step9")  # names a checkpoint that is not there
    for script, flags, says in (("train_deepspeed.py", ["--model", "cnn", "--activation-checkpointing"], "--model mlp"),
                                ("train_fsdp.py", ["--log-dir", "tb"], "does not implement --log-dir"),
                                ("train_deepspeed.py", ["--zero-stage", "0", "--offload-optimizer"], "stage 0 has none"),
                                ("train_deepspeed.py", [*tiny[:-2], "--ckpt-dir", str(not_zero)],
                                 "holds no ZeRO checkpoint this run can read")):
        with pytest.raises(LaunchError) as refused:
            run_script(script, flags, env=ONE_THREAD, timeout_s=120, echo=False)
        assert refused.value.result.output.strip().splitlines()[-1].startswith("error: ") and says in \
            refused.value.result.output
