"""ZeRO and FSDP2 on 2 CPU processes: what each rank holds, measured against the theory
(course_utils.sharding), the loss, ZeRO checkpoints (consolidated and resumed), and FSDP2 beside ZeRO-3."""

import pytest

from course_utils.launch import LaunchError, run_script
from course_utils.results import parse_result
from course_utils.sharding import comm_theory, zero_theory

# Adam in bf16, accumulation over 2 micro-batches: the regime where the four stages differ
RUN = ["--model", "mlp", "--optimizer", "adamw", "--lr", "1e-3", "--precision", "bf16", "--epochs", "2",
       "--n-train", "512", "--n-val", "128", "--batch-size", "16", "--grad-accum", "2", "--workers", "0",
       "--no-progress"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}
# ZeRO pads each flat partition to a multiple of the ranks: a few elements per parameter group
PADDING_BYTES = 64


def test_theory_reproduces_the_zero_paper():
    """Rajbhandari et al. 2020, Figure 1: 7.5 B parameters, Adam in mixed precision, 64 ranks:
    120 GB per rank without ZeRO, 31.4 GB with stage 1, 16.6 GB with stage 2, 1.9 GB with stage 3."""
    per_rank = [sum(zero_theory(7_500_000_000, 64, stage).values()) / 1e9 for stage in range(4)]
    assert [round(gb, 1) for gb in per_rank] == [120.0, 31.4, 16.6, 1.9]
    assert comm_theory(10**6, 8, 3) == pytest.approx(1.5 * comm_theory(10**6, 8, 2))
    with pytest.raises(ValueError, match="stage"):
        zero_theory(10, 2, 4)


@pytest.fixture(scope="module")
def zero_runs(tmp_path_factory):
    """Each ZeRO stage once (stages 1-3 with a checkpoint directory)."""
    runs = {}
    for stage in range(4):
        ckpt = ["--ckpt-dir", str(tmp_path_factory.mktemp(f"stage{stage}"))] if stage else []
        run = run_script("train_deepspeed.py", [*RUN, "--zero-stage", str(stage), *ckpt], nproc=2,
                         env=ONE_THREAD, timeout_s=300, echo=False)
        runs[stage] = (parse_result(run.output), ckpt)
    return runs


def test_each_zero_stage_holds_what_the_theory_says(zero_runs):
    sharded_by = {}
    for stage, (result, _) in zero_runs.items():
        assert result["world_size"] == 2 and result["ranks_agree"], result
        assert result["train_loss"][-1] < result["train_loss"][0], f"stage {stage} did not learn"
        for part, measured in result["memory"].items():
            if part in result["theory"]:
                assert abs(measured - result["theory"][part]) <= PADDING_BYTES, (stage, part, result["memory"])
        sharded_by[stage] = {part for part in ("params", "gradients", "optimizer")
                             if result["memory"][part] < 0.6 * zero_runs[0][0]["memory"][part]}
    assert sharded_by == {0: set(), 1: {"optimizer"}, 2: {"optimizer", "gradients"},
                          3: {"optimizer", "gradients", "params"}}
    # stage 3 gathers the weights in the forward and again in the backward pass; the others never
    assert zero_runs[3][0]["collectives_per_step"].get("all_gather_into_tensor", 0) > 2
    assert "reduce_scatter_tensor" not in zero_runs[0][0]["collectives_per_step"]


def test_the_consolidated_checkpoint_equals_the_trained_weights(zero_runs):
    for stage in (1, 2, 3):
        assert zero_runs[stage][0]["consolidated_max_abs_diff"] == 0.0, stage


def test_a_resumed_zero_run_continues_the_same_run(zero_runs, tmp_path):
    """One epoch, then a second run resumes from the ZeRO checkpoint: it ends where the
    uninterrupted run of the fixture ends, step for step and loss for loss."""
    reference = zero_runs[3][0]
    args = [*RUN, "--zero-stage", "3", "--ckpt-dir", str(tmp_path)]
    first = parse_result(run_script("train_deepspeed.py", [*args, "--epochs", "1"], nproc=2,
                                    env=ONE_THREAD, timeout_s=300, echo=False).output)
    assert first["global_step"] == reference["global_step"] // 2
    second = run_script("train_deepspeed.py", args, nproc=2, env=ONE_THREAD, timeout_s=300, echo=False)
    assert "resumed from" in second.output
    resumed = parse_result(second.output)
    assert resumed["global_step"] == reference["global_step"]
    assert resumed["train_loss"] == reference["train_loss"]
    with pytest.raises(LaunchError) as refused:  # the per-rank batch is part of the run: not resumed
        run_script("train_deepspeed.py", [*args, "--batch-size", "32", "--grad-accum", "1"], nproc=2,
                   env=ONE_THREAD, timeout_s=300, echo=False)
    assert "batch_size 16 -> 32" in refused.value.result.output


def test_fsdp2_shards_like_zero3_and_learns_the_same(zero_runs):
    run = run_script("train_fsdp.py", RUN, nproc=2, env=ONE_THREAD, timeout_s=300, echo=False)
    result, zero3 = parse_result(run.output), zero_runs[3][0]
    psi, ranks = result["psi"], 2
    # fp32 shards of the weights (also the master copy), fp32 gradient shards, Adam's moments
    assert result["memory"]["params"] == pytest.approx(4 * psi / ranks, abs=PADDING_BYTES)
    assert result["memory"]["gradients"] == pytest.approx(4 * psi / ranks, abs=PADDING_BYTES)
    assert result["memory"]["optimizer"] == pytest.approx(8 * psi / ranks, abs=PADDING_BYTES)
    assert sum(result["memory"][p] for p in ("params", "gradients", "optimizer")) == pytest.approx(
        sum(zero3["theory"].values()), abs=3 * PADDING_BYTES), "16 bytes per parameter over N ranks, as ZeRO-3"
    assert result["ranks_agree"] and result["global_step"] == zero3["global_step"]
    assert result["val_loss"] == pytest.approx(zero3["val_loss"], rel=0.05), "the same run, sharded by another tool"


def test_one_process_without_a_launcher_and_one_line_errors():
    """`python scripts/train_deepspeed.py` is a group of one (DeepSpeed alone would look for MPI);
    a flag the script cannot honour stops it before DeepSpeed starts, in one line."""
    tiny = ["--model", "mlp", "--epochs", "1", "--n-train", "64", "--n-val", "32", "--batch-size", "16",
            "--workers", "0", "--no-progress", "--zero-stage", "1"]
    result = parse_result(run_script("train_deepspeed.py", tiny, env=ONE_THREAD, timeout_s=300, echo=False).output)
    assert result["world_size"] == 1 and result["global_step"] == 4
    for script, flags, says in (("train_deepspeed.py", ["--model", "cnn", "--activation-checkpointing"], "--model mlp"),
                                ("train_fsdp.py", ["--log-dir", "tb"], "does not implement --log-dir")):
        with pytest.raises(LaunchError) as refused:
            run_script(script, flags, env=ONE_THREAD, timeout_s=120, echo=False)
        assert refused.value.result.output.strip().splitlines()[-1].startswith("error: ") and says in \
            refused.value.result.output
