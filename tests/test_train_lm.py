"""The course's transformer (course_utils.llama) split by course_utils.parallel, checked against the unsplit model.

Every layout trains the same decoder on the same tokens from the same seed, so each must give the unsplit run's
losses and gradient norms step for step. They are not bit-equal: each layout sums the same numbers in another
order (FSDP2's reduce-scatter, tensor parallel's all-reduces, the vocabulary's split softmax), so fp32 rounding
(2^-24 relative per operation) differs, and Adam carries it into the next steps. Four steps of the tiny model
differed by at most 4e-7 relative on a 2-core machine; the bound is 1e-5, while a layout that drops or
duplicates one rank's share of the batch moves the second step's loss by about 1e-2.
"""

import pytest
import torch

from course_utils.launch import run_script, start_script
from course_utils.llama import LM_SIZES, build_llama, flops_per_token
from course_utils.parallel import MESH_DIMS, ParallelDims, apply_ac
from course_utils.results import parse_result

STEPS = 4
GLOBAL_BATCH = 16
RUN = ["--steps", STEPS, "--precision", "fp32", "--log-every", 100]
REL = 1e-5
# name: (ranks, flags); --batch-size is per data-parallel rank, so every layout's step takes the same 16 sequences
# (torch.compile per block runs on the GPU lease, make gpu-check: on a CPU, inductor's C++ build of the kernels
# cost 86 CPU-s of a 2-rank run here, six times its training)
LAYOUTS = {
    "HSDP 2x2": (4, ["--dp-replicate", 2, "--dp-shard", 2]),
    "FSDP2 x TP": (4, ["--dp-shard", 2, "--tp", 2]),
    "PP x FSDP2, GPipe": (4, ["--pp", 2, "--dp-shard", 2, "--pp-schedule", "gpipe"]),
    "CP x FSDP2 (ring attention)": (4, ["--cp", 2, "--dp-shard", 2]),
    "CP x TP": (4, ["--cp", 2, "--tp", 2]),
}
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _batch(flags):
    flags = [f for f in flags if f != "--pp-schedule" and f != "gpipe"]
    degrees = {flags[i].lstrip("-").replace("-", "_"): flags[i + 1] for i in range(0, len(flags), 2)}
    dims = ParallelDims(**{k: v for k, v in degrees.items() if k in MESH_DIMS + ("ep",)})
    return ["--batch-size", GLOBAL_BATCH // dims.dp]


def _start(flags, nproc=None, *extra):
    return start_script("train_lm.py", [*RUN, *_batch(flags), *flags, *extra], nproc=nproc, env=ONE_THREAD)


def _close(got, want):
    return all(abs(a - b) <= REL * abs(b) for a, b in zip(got, want, strict=True))


@pytest.fixture(scope="module")
def unsplit():
    return parse_result(_start([]).wait(timeout_s=180).output)


def test_every_layout_trains_the_unsplit_model_step_for_step(unsplit):
    """What notebooks 07 (FSDP2), 09 (TP, PP under 1F1B, PP x TP) and 12 (CP, EP) do not run on CI's 2 ranks:
    HSDP, FSDP2 x TP, PP x FSDP2 under GPipe, and context parallel (ring attention, zig-zag) with FSDP2 and with
    TP, on 4 ranks: the losses, the gradients' norms (over every shard and stage) and the held-out loss of the
    unsplit run."""
    jobs = {name: _start(flags, nproc) for name, (nproc, flags) in LAYOUTS.items()}  # at once: 21 ranks, 2 cores
    for name, job in jobs.items():
        got = parse_result(job.wait(timeout_s=420).output)
        assert got["world_size"] == LAYOUTS[name][0] and got["tokens_per_step"] == unsplit["tokens_per_step"]
        assert _close(got["losses"], unsplit["losses"]), (name, got["losses"], unsplit["losses"])
        assert _close(got["grad_norms"], unsplit["grad_norms"]), (name, got["grad_norms"], unsplit["grad_norms"])
        assert _close([got["val_loss"]], [unsplit["val_loss"]]), name
    assert unsplit["losses"][-1] < unsplit["losses"][0] - 0.5, "the decoder learns the bytes"


def test_a_run_stopped_on_one_layout_resumes_on_another_where_the_unstopped_run_ends(unsplit, tmp_path):
    """Two steps on two tensor-parallel ranks (each holding half of every matrix, split by rows or columns),
    checkpointed with torch.distributed.checkpoint; the last two on two FSDP2 ranks, which read their own shards
    (split by rows, across matrices) of the same tensors; then a run that would change the global batch is
    refused in one line. (A pipeline stage's names are the whole model's: the test after next.)"""
    ckpt = ["--ckpt-dir", tmp_path]
    first = parse_result(start_script("train_lm.py", [*RUN[2:], "--steps", 2, "--batch-size", GLOBAL_BATCH,
                                                      "--tp", 2, *ckpt], nproc=2, env=ONE_THREAD).wait(180).output)
    second = parse_result(_start(["--dp-shard", 2], 2, *ckpt).wait(timeout_s=180).output)
    assert second["resumed_from"]["layout"] == {"pp": 1, "dp_replicate": 1, "dp_shard": 1, "cp": 1, "tp": 2, "ep": 1}
    assert first["losses"] == second["losses"][:2] and second["steps"] == STEPS
    assert _close(second["losses"], unsplit["losses"]), (first["losses"], second["losses"], unsplit["losses"])
    refused = run_script("train_lm.py", [*RUN, "--steps", STEPS + 1, "--batch-size", 4, *ckpt], check=False,
                         echo=False)
    assert refused.returncode == 2
    assert refused.output.strip().splitlines()[-1] == (
        f"error: {tmp_path} was written by another run (global batch 16 -> 4 (--batch-size x data-parallel "
        "ranks)): use a new --ckpt-dir")


def test_a_mixture_of_experts_trains_the_same_losses_sharded_spread_and_with_the_sequence_split():
    """--experts 4 (every MLP a mixture, 2 experts a token, no capacity: no token dropped) in one process, on 2
    FSDP2 ranks, on 2 context-parallel ranks, and with the experts spread over 2 ranks (expert parallel: tokens
    dispatched and combined by all-to-all) within each of 2 replicas (HSDP); notebook 12 runs EP over FSDP2's
    ranks. The balancing loss is left out (--aux-loss 0): each rank would balance its own tokens, which changes
    the gradient with the split."""
    moe = ["--experts", 4, "--aux-loss", 0]
    one = _start([], None, *moe)
    jobs = {"FSDP2": _start(["--dp-shard", 2], 2, *moe), "CP": _start(["--cp", 2], 2, *moe),
            "EP x HSDP": _start(["--dp-replicate", 2, "--dp-shard", 2, "--ep", 2], 4, *moe)}
    one = parse_result(one.wait(timeout_s=180).output)
    for name, job in jobs.items():
        got = parse_result(job.wait(timeout_s=180).output)
        assert _close(got["losses"], one["losses"]) and _close(got["grad_norms"], one["grad_norms"]), (name, got, one)
    assert one["flops_per_token"] == flops_per_token(build_llama("tiny", experts=4).shape, 64)


def test_a_layout_that_does_not_fit_is_refused_with_what_to_change():
    shape = LM_SIZES["tiny"]
    assert ParallelDims(dp_shard=2, tp=2).problems(2, shape) == [
        "--pp 1 x --dp-replicate 1 x --dp-shard 2 x --cp 1 x --tp 2 = 4 ranks, but 2 were started: make the "
        "product the world size"]
    assert ParallelDims(dp_shard=2, tp=2, ep=2).problems(4, build_llama("tiny", experts=3).shape) == [
        "--ep 2 spreads the experts over the --dp-shard ranks: give --dp-shard 2 (with --dp-replicate if you like), "
        "and no --cp, --tp or --pp with it here",
        "--ep 2 needs --experts, a multiple of 2 (each rank holds experts/ep)"]
    assert ParallelDims(cp=4).problems(4, shape, seq_len=100) == [
        "--seq-len 100 does not split into 2 x --cp = 8 chunks (the zig-zag split of context parallel): make it a "
        "multiple"]
    assert ParallelDims(pp=4).problems(4, shape, batch=6, microbatches=4) == [
        "--pp 4 needs at least a block per stage; the model has 2",
        "--batch-size 6 does not split into --microbatches 4: make it a multiple"]
    assert ParallelDims(tp=4).problems(4, shape) == [
        "--tp 4 does not divide the model's kv_heads (2): each rank holds kv_heads/tp of them"]
    assert len(ParallelDims(tp=3).problems(3, shape)) == 4, "heads, kv_heads, ffn_hidden and vocab: none divides"
    tied = build_llama("tiny", tied=True).shape
    assert ParallelDims(tp=2).problems(2, tied)[-1].startswith("a tied embedding and head cannot be split by --tp")
    assert ParallelDims(pp=2).problems(2, tied)[-1].startswith("a tied embedding and head cannot be cut by --pp")
    assert ParallelDims(dp_shard=4).problems(4, tied) == [], "FSDP2 shards a tied weight as one parameter"
    from course_utils.parallel import float8_problem

    assert float8_problem(torch.device("cpu"), ParallelDims()).startswith(
        "--float8 needs float8 tensor cores (compute capability 8.9+: L4, H100); this device has a CPU")


def test_the_flops_per_token_are_the_matmuls_torch_counts_plus_six_per_norm_weight():
    """flops_per_token against torch's FlopCounterMode over a forward and backward pass (attention through the
    math kernel, whose two matmuls the counter sees; the other kernels it does not count on a CPU)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode

    for size, experts in (("tiny", 0), ("small", 0), ("tiny", 4)):  # a mixture: the router and 2 experts a token
        model, seq = build_llama(size, experts=experts), 32
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(torch.randint(0, 256, (2, seq))).float().sum().backward()
        norms = (2 * model.shape.layers + 1) * model.shape.dim  # 6N counts them; they are no matmul
        assert counter.get_total_flops() / (2 * seq) + 6 * norms == flops_per_token(model.shape, seq), (size, experts)


def _grads(mode):
    model = build_llama("tiny")
    apply_ac(model, mode)
    model(torch.randint(0, 256, (8, 64), generator=torch.Generator().manual_seed(0))).float().logsumexp(-1) \
        .mean().backward()
    return [p.grad for p in model.parameters()]


def test_activation_checkpointing_recomputes_the_same_gradients_bit_for_bit_on_a_cpu():
    """Notebook 07 measures the peak memory and time each mode costs; here, on a CPU (deterministic kernels), the
    recomputed forward gives the very bits of the kept one, so the gradients are equal, not close."""
    none = _grads("none")
    for mode in ("selective", "full"):
        assert all(torch.equal(a, b) for a, b in zip(none, _grads(mode), strict=True)), mode


def test_the_token_batches_are_the_same_sequences_however_they_are_dealt_and_at_any_step():
    from course_utils.data.text import TokenBatches

    tokens = torch.arange(10_000) % 256
    whole = TokenBatches(tokens, 16, 8, seed=3)
    for step in (0, 5, whole.steps_per_epoch + 1):  # the next epoch reshuffles
        x, y = whole.batch_at(step)
        assert torch.equal(y[:, :-1], x[:, 1:])  # the targets are the next tokens
        parts = [TokenBatches(tokens, 16, 2, dp_ranks=4, dp_index=i, seed=3).batch_at(step)[0] for i in range(4)]
        assert torch.equal(torch.cat(parts), x), step
    assert not torch.equal(whole.batch_at(0)[0], whole.batch_at(whole.steps_per_epoch)[0])
    with pytest.raises(ValueError, match="fewer than one step's 64: use more text"):
        TokenBatches(tokens[:500], 16, 16, dp_ranks=4)


def test_the_text_is_this_python_s_own_sources_and_a_missing_file_says_where_to_get_one(tmp_path):
    from course_utils.data.text import load_tokens

    tokens = load_tokens("stdlib", max_bytes=100_000)
    assert len(tokens) == 100_000 and tokens.max() < 256 and bytes(tokens[:200].tolist()).isascii()
    with pytest.raises(ValueError, match="no such file.*tinyshakespeare, on a login node"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "mine.txt").write_text("hello")
    assert bytes(load_tokens(str(tmp_path / "mine.txt")).tolist()) == b"hello"


def test_a_pipeline_stage_keeps_its_blocks_under_the_whole_model_s_names():
    """The first stage holds the embedding, the last the norm and the head; every parameter is on exactly one
    stage under its unsplit name, so the stages' checkpoints are together the model's."""
    from course_utils.parallel import cut, stage_layers

    assert [stage_layers(5, 3, s) for s in range(3)] == [["0", "1"], ["2"], ["3", "4"]]
    names = [set(dict(cut(build_llama("tiny", layers=4), 3, s).named_parameters())) for s in range(3)]
    whole = set(dict(build_llama("tiny", layers=4).named_parameters()))
    assert set().union(*names) == whole and sum(map(len, names)) == len(whole)
    assert "tok_embeddings.weight" in names[0] and "output.weight" in names[2] and "norm.weight" in names[2]
    assert {n.split(".")[1] for n in names[1]} == {"1", "2"}  # round(4/3)=1 .. round(8/3)=3


def _ring_worker(rank: int, ranks: int, layout: str, init: str, gaps) -> None:
    import torch.distributed as dist
    import torch.nn.functional as F

    from course_utils.parallel.context import positions, ring_attention, shard

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)  # the same whole sequence on every rank: the reference, and each rank's share of it
        q, k, v, grad = (torch.randn(2, 3, 16, 8) for _ in range(4))
        whole = [t.clone().requires_grad_() for t in (q, k, v)]
        reference = F.scaled_dot_product_attention(*whole, is_causal=True)
        (reference * grad).sum().backward()
        mine = [shard(t, layout, rank, ranks, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = ring_attention(*mine, positions(layout, rank, ranks, 16), dist.group.WORLD, layout)
        (out * shard(grad, layout, rank, ranks, dim=2)).sum().backward()
        gaps[(layout, ranks, rank)] = max(
            [(out - shard(reference, layout, rank, ranks, dim=2)).abs().max().item()]
            + [(m.grad - shard(w.grad, layout, rank, ranks, dim=2)).abs().max().item() for m, w in zip(mine, whole)])
    finally:
        dist.destroy_process_group()


def test_ring_attention_is_causal_attention_forward_and_backward_on_every_split(tmp_path):
    """Each rank's share of the output and of the query, key and value gradients equals the unsplit attention's
    (torch's scaled_dot_product_attention), within fp32 rounding of sums taken in another order: the online
    softmax's merge is exact, so 1e-5 on values of order 1 (measured: 7e-7)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        gaps = manager.dict()
        for layout, ranks in (("contiguous", 2), ("zigzag", 2), ("zigzag", 4)):
            mp.start_processes(_ring_worker, args=(ranks, layout, f"file://{tmp_path / f'{layout}-{ranks}'}", gaps),
                               nprocs=ranks, start_method="spawn")
        gaps = dict(gaps)
    assert len(gaps) == 8 and max(gaps.values()) <= 1e-5, gaps


def test_the_zigzag_split_gives_every_rank_the_same_causal_attention_work():
    from course_utils.parallel.context import attention_work

    contiguous, zigzag = attention_work("contiguous", 4, 64), attention_work("zigzag", 4, 64)
    assert sum(contiguous) == sum(zigzag) == 64 * 65 // 2, "the whole triangle, split"
    assert contiguous == sorted(contiguous) and contiguous[-1] > 6 * contiguous[0]  # the last rank sees every block
    assert len(set(zigzag)) == 1


def _experts_worker(rank: int, ranks: int, init: str, gaps) -> None:
    import copy

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from course_utils.parallel.experts import MoE, apply_ep

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=ranks)
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        whole = MoE(8, 16, experts=4, top_k=2)  # every expert, on every rank: the reference
        spread = copy.deepcopy(whole)
        apply_ep(spread, init_device_mesh("cpu", (ranks,), mesh_dim_names=("ep",))["ep"])
        torch.manual_seed(1 + rank)  # each rank its own tokens, as data-parallel ranks have
        x, grad = torch.randn(3, 5, 8), torch.randn(3, 5, 8)
        reference, out = whole(x), spread(x)
        (reference * grad).sum().backward()
        (out * grad).sum().backward()
        local = 4 // ranks
        found = [(out - reference).abs().max().item(),
                 (spread.router.weight.grad - whole.router.weight.grad).abs().max().item()]
        for name in ("w1", "w3", "w2"):  # an expert's gradient: from every rank's tokens that reached it
            summed = getattr(whole, name).grad.clone()
            dist.all_reduce(summed)
            found.append((getattr(spread, name).grad - summed[rank * local:(rank + 1) * local]).abs().max().item())
        gaps[(ranks, rank)] = (max(found), len(getattr(spread, "w1")))
    finally:
        dist.destroy_process_group()


def test_experts_spread_over_ranks_compute_the_one_rank_layer_forward_and_backward(tmp_path):
    """Four experts on 2 and on 4 ranks, dispatched and combined with all_to_all_single: each rank's output and its
    router's gradient are the one-rank layer's, each expert's gradient the sum over every rank's tokens."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        gaps = manager.dict()
        for ranks in (2, 4):
            mp.start_processes(_experts_worker, args=(ranks, f"file://{tmp_path / str(ranks)}", gaps), nprocs=ranks,
                               start_method="spawn")
        gaps = dict(gaps)
    assert len(gaps) == 6 and max(g for g, _ in gaps.values()) <= 1e-6, gaps
    assert {held for (ranks, _), (_, held) in gaps.items() if ranks == 4} == {1}, "each of 4 ranks holds one expert"


def test_a_capacity_drops_the_tokens_over_it_and_the_balancing_loss_reads_the_router():
    from course_utils.parallel.experts import MoE

    torch.manual_seed(0)
    tokens = torch.randn(64, 8)
    moe = MoE(8, 16, experts=4, top_k=1)
    with torch.no_grad():
        moe.router.weight.zero_()
        moe.router.weight[0] = 1.0  # every token prefers expert 0 where its features sum positive
    moe(tokens)
    skewed = (moe.stats["load"], moe.aux_loss.item())
    assert moe.stats["dropped"] == 0 and sum(skewed[0]) == 64, "no capacity: every token kept"
    moe.capacity_factor = 1.0
    moe(tokens)
    assert moe.stats["capacity"] == 16 and moe.stats["dropped"] == sum(max(0, n - 16) for n in skewed[0]) > 0
    with torch.no_grad():
        moe.router.weight.zero_()  # every expert equally likely: the loss at its minimum, 1
    moe(tokens)
    assert abs(moe.aux_loss.item() - 1.0) < 1e-6
    assert max(skewed[0]) >= 2 * 64 / 4 and skewed[1] > 1.2, "a skewed router's load, and a loss above its minimum"
