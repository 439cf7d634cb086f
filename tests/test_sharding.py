"""ZeRO's theory against the paper's numbers, and what notebook 07 cannot show: a run without a launcher,
and the refusals (a resume with another batch, flags a script cannot honour). Notebook 07 measures each
stage against the theory on 2 ranks, resumes and consolidates a ZeRO-3 checkpoint, and puts FSDP2 beside
ZeRO-3: those checks live there, run once."""

import pytest

from course_utils.launch import run_script, start_script
from course_utils.results import parse_result
from course_utils.sharding import comm_theory, deepspeed_comm, no_offload_per_gpu, per_step, sent_per_rank, zero_theory

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


def test_the_no_offload_row_is_read_from_the_table_deepspeed_prints():
    """Notebook 07 puts DeepSpeed's estimators beside the theory: the number it reads is the per-GPU cell of
    the row without offload (stage 3: the one with zero_init=1), and a table without one is an error, not 0."""
    stage3 = """  per CPU  |  per GPU |   Options
   20.95GB |   0.47GB | offload_param=none, offload_optimizer=OffloadDeviceEnum.cpu, zero_init=1
    3.00GB |   2.21GB | offload_param=none, offload_optimizer=none, zero_init=1
  335.28GB |   2.21GB | offload_param=none, offload_optimizer=none, zero_init=0"""
    assert no_offload_per_gpu(stage3) == pytest.approx(2.21 * 2**30)
    stage2 = " 2682.21GB |  13.97GB | offload_optimizer=OffloadDeviceEnum.cpu\n  335.28GB |  15.93GB | offload_optimizer=none"
    assert no_offload_per_gpu(stage2) == pytest.approx(15.93 * 2**30)
    with pytest.raises(ValueError, match="no row without offload"):
        no_offload_per_gpu(stage2.splitlines()[0])


def test_bytes_sent_from_what_each_collective_is_given():
    """DeepSpeed's comms logger and the dispatcher's count record the input of each call: the whole buffer of
    an all-reduce or a reduce-scatter, this rank's shard of an all-gather. On 4 ranks a reduce-scatter of 4 MiB
    and an all-gather of its 1 MiB shards each send 3 MiB from a rank, together what an all-reduce of 4 MiB sends
    (taking the reduce-scatter's input for a shard would make it 12 MiB)."""
    mib = 2**20
    assert sent_per_rank("reduce_scatter_tensor", 4 * mib, 4) == 3 * mib
    assert sent_per_rank("all_gather_into_tensor", 1 * mib, 4) == 3 * mib
    assert sent_per_rank("all_reduce", 4 * mib, 4) == 6 * mib
    with pytest.raises(ValueError, match="_RING"):
        sent_per_rank("all_to_all", mib, 4)


def test_deepspeed_collectives_against_the_paper():
    """What DeepSpeed's ZeRO sends per step (deepspeed_comm) against the paper (comm_theory), 8 ranks, 4
    micro-batches: stages 0 and 3 are the paper's; stages 1 and 2 all-reduce where the paper reduce-scatters,
    one more pass of Psi per reduction: 1 for stage 1, 4 for stage 2. And a ZeRO-3 step as the logger records
    it (2 x 4 all-gathers of a 1/8 shard, 4 reduce-scatters of the whole bf16 gradients), read back by per_step."""
    psi, ranks, accum = 10**6, 8, 4
    one_pass = 2 * psi * (ranks - 1) / ranks  # bf16 bytes a rank sends to reduce-scatter or all-gather Psi
    ours = [sum(deepspeed_comm(psi, ranks, s, grad_accum=accum).values()) for s in range(4)]
    paper = [comm_theory(psi, ranks, s, grad_accum=accum) for s in range(4)]
    assert [(o - p) / one_pass for o, p in zip(ours, paper)] == pytest.approx([0, 1, accum, 0])
    logged = per_step({"all_gather_into_tensor": 2 * accum, "reduce_scatter_tensor": accum, "barrier": 1},
                      {"all_gather_into_tensor": 2 * accum * 2 * psi / ranks, "reduce_scatter_tensor": accum * 2 * psi,
                       "barrier": 0}, steps=1, ranks=ranks)
    assert {op: r["sent"] for op, r in logged.items()} == pytest.approx(deepspeed_comm(psi, ranks, 3, grad_accum=accum))
    with pytest.raises(ValueError, match="stage"):
        deepspeed_comm(psi, ranks, 4)


def test_fsdp_parameter_groups_in_either_torch():
    """FSDP2 keeps its parameter groups as a list (torch 2.14, here) or as one group per module (torch 2.11, the GPU
    machines': read there, where the list was missing and accumulation's unsharded gradients went uncounted).
    Notebook 07 checks the count on real FSDP2; this gives the older layout as input. A model with no group
    at all is refused, not counted as holding no whole gradients."""
    from types import SimpleNamespace

    import torch

    from course_utils.sharding import _fsdp_param_groups, fsdp_gradient_bytes

    class Sharded(torch.nn.Linear):
        def __init__(self, state):
            super().__init__(2, 2)
            self.state = state

        def _get_fsdp_state(self):
            return self.state

    group = SimpleNamespace(fsdp_params=[])
    assert _fsdp_param_groups(Sharded(SimpleNamespace(_fsdp_param_groups=[group, group]))) == [group, group]
    assert _fsdp_param_groups(Sharded(SimpleNamespace(_fsdp_param_group=group))) == [group]  # torch 2.11
    assert _fsdp_param_groups(Sharded(SimpleNamespace(_fsdp_param_group=None))) == []  # a module with no parameters
    whole = torch.zeros(10)  # a unit's whole gradients, accumulated while sync is off
    unit = Sharded(SimpleNamespace(_fsdp_param_group=SimpleNamespace(
        fsdp_params=[SimpleNamespace(unsharded_accumulated_grad=whole, _unsharded_param=None)])))
    assert fsdp_gradient_bytes(unit) == whole.nbytes
    with pytest.raises(RuntimeError, match="no FSDP2 parameter group"):
        fsdp_gradient_bytes(torch.nn.Linear(2, 2))


def test_one_process_without_a_launcher_and_one_line_errors(tmp_path):
    """`python scripts/train_deepspeed.py` is a group of one (DeepSpeed alone would look for MPI); its
    checkpoint refuses a resume with another per-rank batch; a flag a script cannot honour stops it
    before DeepSpeed starts, in one line; so do a folder that holds no ZeRO checkpoint and an
    offload that stage 0 cannot do."""
    tiny = ["--model", "mlp", "--epochs", "1", "--n-train", "64", "--n-val", "32", "--batch-size", "16",
            "--workers", "0", "--no-progress", "--zero-stage", "1", "--ckpt-dir", str(tmp_path)]
    result = parse_result(run_script("train_deepspeed.py", tiny, env=ONE_THREAD, timeout_s=300, echo=False).output)
    assert result["world_size"] == 1 and result["global_step"] == 4
    not_zero = tmp_path / "not-zero"
    not_zero.mkdir()
    (not_zero / "latest").write_text("global_step9")  # names a checkpoint that is not there
    refusals = [  # (script, flags, what its one line says, whether that line is an "error: " line)
        ("train_deepspeed.py", [*tiny, "--epochs", "2", "--batch-size", "32"], "batch_size 16 -> 32", False),
        ("train_deepspeed.py", ["--model", "cnn", "--activation-checkpointing"], "--model mlp", True),
        ("train_fsdp.py", ["--log-dir", "tb", "--trace-dir", "tr"], "does not implement --log-dir, --trace-dir", True),
        ("train_deepspeed.py", ["--zero-stage", "0", "--offload-optimizer"], "stage 0 has none", True),
        ("train_deepspeed.py", [*tiny[:-2], "--ckpt-dir", str(not_zero)], "holds no ZeRO checkpoint this run can read",
         True),
        # a ZeRO checkpoint there, but no Universal one (notebook 07 converts one and resumes it with --universal)
        ("train_deepspeed.py", [*tiny, "--epochs", "2", "--universal"], "convert a ZeRO checkpoint first", True)]
    # independent one-process runs, started together: on two cores, two import torch at once
    jobs = [(start_script(script, flags, env=ONE_THREAD), says, one_line) for script, flags, says, one_line in refusals]
    for job, says, one_line in jobs:
        out = job.wait(timeout_s=300, check=False)
        assert out.returncode != 0 and says in out.output, out.output[-3000:]
        assert not one_line or out.output.strip().splitlines()[-1].startswith("error: "), out.output[-3000:]
