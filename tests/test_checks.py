"""Notebook claims that read a run's results (course_utils.checks): each passes the run the lesson describes and
fails, naming the claim, on a run where the lesson would be wrong."""

import copy

import pytest

from course_utils.checks import check_asha_against_fifo, check_four_trainers
from course_utils.claims import ClaimFailed


def _trainer(val_loss=2.0, steps=12, resumed_epoch=None):
    row = {"ranks_agree": True, "world_size": 2, "global_step": steps, "train_loss": [2.3, 2.0], "val_loss": val_loss}
    return {**row, "resumed_from": {"epoch": resumed_epoch, "step": 6}} if resumed_epoch is not None else row


FOUR = {"course Trainer": _trainer(), "loop by hand": _trainer(), "Lightning": _trainer(),
        "Fabric": _trainer(resumed_epoch=1)}


def test_four_trainers_at_one_loss_pass():
    check_four_trainers(FOUR, 2)


@pytest.mark.parametrize("name, change, claim", [
    ("Lightning", {"val_loss": 2.0 + 1e-12}, "one validation loss, bit for bit"),  # the last bit differs
    ("loop by hand", {"global_step": 11}, "as many optimiser steps as the others"),
    ("Fabric", {"resumed_from": {"epoch": 0, "step": 0}}, "went on from the first's checkpoint"),
    ("course Trainer", {"ranks_agree": False}, "ranks whose weights agree"),
])
def test_four_trainers_that_differ_fail_on_the_claim_that_broke(name, change, claim):
    rows = copy.deepcopy(FOUR)
    rows[name].update(change)
    with pytest.raises(ClaimFailed, match=claim):
        check_four_trainers(rows, 2)


def _trial(config, val_loss, status="completed"):
    return {"config": config, "val_loss": val_loss, "epochs": len(val_loss), "status": status}


FIFO_ROWS = [_trial({"lr": 0.1}, [1.0, 0.8, 0.6]), _trial({"lr": 0.01}, [1.5, 1.4, 1.3])]
ASHA_ROWS = [_trial({"lr": 0.1}, [1.0, 0.8, 0.6]), _trial({"lr": 0.01}, [1.5], "stopped early")]
FIFO = {"errored": 0, "epochs": 6, "held_out_loss": 0.7, "held_out_acc": 0.6}
ASHA = {"errored": 0, "epochs": 4, "stopped_early": 1}


def test_asha_that_stopped_the_trial_behind_passes():
    check_asha_against_fifo(ASHA_ROWS, FIFO_ROWS, ASHA, FIFO, (2.2, 0.1), on_gpu=False)


@pytest.mark.parametrize("asha_rows, claim", [
    # the scheduler ranked the wrong way round: it stopped the better trial and kept the worse
    ([_trial({"lr": 0.1}, [1.0], "stopped early"), _trial({"lr": 0.01}, [1.5, 1.4, 1.3])], "the trial best after"),
    # a stopped trial that trained otherwise than the same draw run to the end
    ([_trial({"lr": 0.1}, [1.0, 0.8, 0.6]), _trial({"lr": 0.01}, [1.6], "stopped early")], "changed nothing else"),
])
def test_asha_that_stopped_the_wrong_trial_or_trained_otherwise_fails(asha_rows, claim):
    with pytest.raises(ClaimFailed, match=claim):
        check_asha_against_fifo(asha_rows, FIFO_ROWS, ASHA, FIFO, (2.2, 0.1), on_gpu=False)


def test_a_search_no_better_than_a_bad_configuration_fails():
    with pytest.raises(ClaimFailed, match="found a better model"):
        check_asha_against_fifo(ASHA_ROWS, FIFO_ROWS, ASHA, FIFO, (0.69, 0.58), on_gpu=False)


BAD = {"record": {"JobState": "FAILED"}, "log": "error: --devices 1: pass --devices 2\n",
       "errors": ["error: --devices 1: pass --devices 2"]}


def _good(resumed_at=20, final_steps=96):
    return {"record": {"JobState": "COMPLETED", "Restarts": "1"}, "ckpt": "/runs/ckpt/last.ckpt",
            "first": {"global_step": 20, "stopped": True, "resumed_from": None},
            "final": {"global_step": final_steps, "epochs": 3, "stopped": False, "resumed_from": "/runs/ckpt/last.ckpt",
                      "resumed_at_step": resumed_at}}


def test_a_requeued_lightning_job_resumed_at_its_step_passes_and_one_that_restarted_fails():
    from course_utils.checks import check_lightning_jobs

    check_lightning_jobs(BAD, 2, _good(), 3, 32)
    with pytest.raises(ClaimFailed, match="at the step the first stopped at"):
        check_lightning_jobs(BAD, 2, _good(resumed_at=0), 3, 32)  # began its epochs again
    with pytest.raises(ClaimFailed, match="every step once"):
        check_lightning_jobs(BAD, 2, _good(final_steps=116), 3, 32)  # trained the stopped epoch's steps twice


# --------------------------------------------------------------------------- #
# 07: the ZeRO stages and FSDP2 (course_utils.checks.sharding)
# --------------------------------------------------------------------------- #
PSI, N = 3_946_506, 2


def _stages():
    from course_utils.sharding import STAGES, zero_theory

    rows = {}
    for s in STAGES:
        theory = zero_theory(PSI, N, s)
        rows[s] = {"memory": dict(theory), "theory": theory, "ranks_agree": True, "train_loss": [2.3, 2.1]}
    return rows


def test_zero_stages_at_the_theory_pass_and_a_stage_that_did_not_shard_fails():
    from course_utils.checks import check_zero_stages

    check_zero_stages(_stages(), N)
    stages = _stages()
    stages[2]["memory"]["gradients"] *= N  # stage 2 left its gradients whole
    with pytest.raises(ClaimFailed, match="theory's bytes"):
        check_zero_stages(stages, N)


def _counted(stage, factor=1.0, dtype="bfloat16"):
    from course_utils.sharding import deepspeed_comm

    want = deepspeed_comm(PSI, N, stage, "bf16", 2)
    return {"logger": {op: {"sent": b * factor} for op, b in want.items()},
            "dispatcher": {op: {"sent": b * factor, "by_dtype": {dtype: b * factor}} for op, b in want.items()}}


@pytest.mark.parametrize("factor, dtype, claim", [(2.0, "bfloat16", "within 1%"), (1.0, "float32", "weights' dtype")])
def test_zero_comm_counts_deepspeeds_collectives_and_rejects_a_doubled_count_or_another_dtype(factor, dtype, claim):
    from course_utils.checks import check_zero_comm

    stages = {s: {"collectives": _counted(s)} for s in range(4)}
    check_zero_comm(stages, PSI, N, "bf16", 2, wire="bfloat16")
    stages[3] = {"collectives": _counted(3, factor, dtype)}
    with pytest.raises(ClaimFailed, match=claim):
        check_zero_comm(stages, PSI, N, "bf16", 2, wire="bfloat16")


def test_zero_resume_that_loaded_the_first_runs_weights_passes_and_a_fresh_start_fails():
    from course_utils.checks import check_zero_resume

    first = {"global_step": 8, "final_weights": "ab12"}
    second = {"resumed_from": {"step": 8, "weights": "ab12"}, "global_step": 16, "train_loss": [2.3, 2.1],
              "consolidated_max_abs_diff": 0.0}
    check_zero_resume(first, second, {"train_loss": [2.3, 2.1]}, on_gpu=False)
    with pytest.raises(ClaimFailed, match="loaded the weights"):  # same steps and losses, its own weights
        check_zero_resume(first, {**second, "resumed_from": {"step": 8, "weights": "cd34"}}, {"train_loss": [2.3, 2.1]},
                          on_gpu=False)


def test_fsdp_holding_unsharded_gradients_when_syncing_every_micro_batch_fails():
    from course_utils.checks import check_fsdp_against_zero3

    zero3 = {"memory": {"params": 2 * PSI / N, "gradients": 2 * PSI / N, "optimizer": 12 * PSI / N}, "global_step": 8,
             "val_loss": 2.0}
    fsdp = {"psi": PSI, "memory": {"params": 4 * PSI / N, "gradients": 4 * PSI / N, "optimizer": 8 * PSI / N},
            "ranks_agree": True, "global_step": 8, "val_loss": 2.01}
    unsynced = {**fsdp, "memory": {**fsdp["memory"], "gradients": 4 * PSI}}
    check_fsdp_against_zero3(fsdp, unsynced, zero3, N, on_gpu=False)
    with pytest.raises(ClaimFailed, match="ZeRO-3's total"):
        check_fsdp_against_zero3(unsynced, unsynced, zero3, N, on_gpu=False)


def test_fsdp_on_the_transformer_that_parted_from_the_unsplit_losses_fails():
    from course_utils.checks import check_fsdp_transformer

    one = {"tokens_per_step": 1024, "world_size": 1, "losses": [5.34, 5.26, 4.84], "grad_norms": [3.1, 2.5, 2.7]}
    sharded = {**one, "world_size": 2, "losses": [5.3400001, 5.2600002, 4.84], "grad_norms": [3.1, 2.5000001, 2.7]}
    check_fsdp_transformer(one, sharded, ranks=2)
    with pytest.raises(ClaimFailed, match="trained its losses step for step"):  # a tie broken: step 2 parts
        check_fsdp_transformer(one, {**sharded, "losses": [5.34, 5.27, 4.86]}, ranks=2)
    with pytest.raises(ClaimFailed, match="took the unsplit run's 1,024 tokens"):  # each rank the whole batch
        check_fsdp_transformer(one, {**sharded, "tokens_per_step": 2048}, ranks=2)


def test_activation_checkpointing_that_saved_nothing_or_cost_nothing_fails():
    from course_utils.checks import check_activation_checkpointing

    measured = {"none": (48.0, 60.0), "selective": (33.0, 90.0), "full": (23.0, 85.0)}
    check_activation_checkpointing(measured, grads_equal=True)
    with pytest.raises(ClaimFailed, match="full checkpointing lowered it most"):
        check_activation_checkpointing({**measured, "full": (40.0, 85.0)}, grads_equal=True)
    with pytest.raises(ClaimFailed, match="and cost time"):  # nothing recomputed
        check_activation_checkpointing({**measured, "full": (23.0, 59.0)}, grads_equal=True)
    with pytest.raises(ClaimFailed, match="the same gradients"):
        check_activation_checkpointing(measured, grads_equal=False)


# --------------------------------------------------------------------------- #
# 09: the pipeline, tensor and sequence parallelism (course_utils.checks.parallelism)
# --------------------------------------------------------------------------- #
def _pipe(interleaved=(0.31, 0.19, 0.13)):
    from course_utils.pipeline import bubble_theory

    rows = [{"schedule": name, "chunks": 1, "microbatches": m, "bubble": bubble_theory(4, m) + 0.01, "bare_s": 0.02,
             "step_s": 0.5, "order_theory": None, "events": []} for name in ("gpipe", "1f1b") for m in (4, 8, 16)]
    rows += [{"schedule": "interleaved", "chunks": 2, "microbatches": m, "bubble": b, "bare_s": 0.03, "step_s": 0.6,
              "order_theory": None, "events": []} for m, b in zip((4, 8, 16), interleaved)]
    gaps = {"loss_diff": 1e-7, "param_diff": 1e-8}
    return {"stages": 4, "against_unsplit": {"gpipe": gaps, "1f1b": gaps, "interleaved": gaps}, "timed": rows}


def test_pipeline_on_its_formula_passes_and_interleaving_that_waited_longer_fails():
    from course_utils.checks import check_pipeline

    check_pipeline(_pipe(), on_gpu=False)
    with pytest.raises(ClaimFailed, match="interleaving waited less"):
        check_pipeline(_pipe(interleaved=(0.45, 0.19, 0.13)), on_gpu=False)


def test_a_transformer_layout_that_parted_from_the_unsplit_run_fails():
    from course_utils.checks import check_transformer_layouts

    one = {"tokens_per_step": 1024, "world_size": 1, "losses": [5.59, 5.23, 4.91], "grad_norms": [3.08, 2.45, 2.66]}
    tp = {**one, "world_size": 2, "losses": [5.5900003, 5.23, 4.91]}
    check_transformer_layouts(one, {"tensor parallel": tp}, on_gpu=False)
    half = {**tp, "tokens_per_step": 512, "losses": [5.59, 5.25, 4.97]}  # each pipeline stage fed half the batch
    with pytest.raises(ClaimFailed, match="a pipeline on 2 ranks took the unsplit run's 1,024 tokens"):
        check_transformer_layouts(one, {"tensor parallel": tp, "a pipeline": half}, on_gpu=False)
    with pytest.raises(ClaimFailed, match="tensor parallel on 2 ranks"):  # its gradients not summed over the shards
        check_transformer_layouts(one, {"tensor parallel": {**tp, "grad_norms": [2.18, 1.73, 1.88]}}, on_gpu=False)


def test_a_zigzag_split_that_left_ranks_uneven_fails_and_a_router_read_as_even_fails():
    from course_utils.checks import check_expert_load, check_zigzag_balance

    triangle = {"contiguous": [136, 392, 648, 904], "zigzag": [520, 520, 520, 520]}
    counted = {"contiguous": [256, 512, 768, 1024], "zigzag": [576, 576, 576, 576]}
    check_zigzag_balance(triangle, counted, counted)
    with pytest.raises(ClaimFailed, match="the same share"):  # a split that only shuffled the chunks
        check_zigzag_balance({**triangle, "zigzag": [392, 136, 904, 648]}, counted, counted)
    with pytest.raises(ClaimFailed, match="whole causal triangle"):  # a split that skipped the diagonal blocks
        check_zigzag_balance({**triangle, "zigzag": [480, 480, 480, 480]}, counted, counted)
    whole_blocks = {**counted, "zigzag": [1024, 1024, 1024, 1024]}  # a ring that skipped no chunk pair
    with pytest.raises(ClaimFailed, match="chunk theory"):
        check_zigzag_balance(triangle, whole_blocks, counted)
    with pytest.raises(ClaimFailed, match="busiest rank"):
        check_zigzag_balance(triangle, whole_blocks, whole_blocks)
    check_expert_load([640, 712, 679, 1291, 711, 405, 2150, 1604], 4096, 2, 1.061)
    with pytest.raises(ClaimFailed, match="every token went to 2 experts"):  # top-1 routing counted as top-2
        check_expert_load([320, 356, 340, 645, 355, 203, 1075, 802], 4096, 2, 1.061)
    with pytest.raises(ClaimFailed, match="balancing loss read it"):
        check_expert_load([640, 712, 679, 1291, 711, 405, 2150, 1604], 4096, 2, 1.0)


def test_interleaved_run_against_a_formula_rejects_1f1bs():
    from course_utils import solutions
    from course_utils.checks import check_interleaved_run
    from course_utils.pipeline import bubble_theory

    rows = [r for r in _pipe()["timed"] if r["schedule"] == "interleaved"]
    check_interleaved_run(rows, 4, solutions.interleaved_bubble)
    with pytest.raises(ClaimFailed, match="your formula"):
        check_interleaved_run(rows, 4, lambda p, m, v: bubble_theory(p, m))  # the chunks left out


def _tp(sp_forward=None):
    theory = {"forward_calls": 4, "backward_calls": 4, "forward_bytes": 8192, "backward_bytes": 8192}
    megatron = {"output_gap": 1e-7, "input_grad_gap": 1e-7, "forward": {"all_reduce": 4}, "backward": {"all_reduce": 4},
                "forward_bytes": {"all_reduce": 8192}, "backward_bytes": {"all_reduce": 8192},
                "params_this_rank": 50, "params_whole": 100}
    shape = {"blocks": 2, "batch": 4, "seq": 16, "hidden": 64}
    norms = 2 * 2 * 4 * 16 * 64 * 4
    sp = {**megatron, "forward": sp_forward or {"all_gather_into_tensor": 4, "reduce_scatter_tensor": 4},
          "forward_bytes": {"all_gather_into_tensor": 4096, "reduce_scatter_tensor": 8192}, "saved_bytes": 100_000 - norms // 2}
    return {"tp": 2, "theory": theory, "by_hand": {"output": 1e-7, "input_grad": 1e-7, "weight_grads": 1e-7},
            "train_loss_gap": 1e-7, "shape": shape,
            "dtensor": {"each layer's own input": {**megatron, "backward": {"all_reduce": 6}},
                        "inputs as one DTensor": {**megatron, "saved_bytes": 100_000}, "sequence parallel": sp}}


def test_tensor_and_sequence_parallel_runs_pass_and_a_sequence_plan_left_on_all_reduces_fails():
    from course_utils.checks import check_sequence_parallel, check_tensor_parallel

    check_tensor_parallel(_tp(), on_gpu=False)
    check_sequence_parallel(_tp(), on_gpu=False)
    with pytest.raises(ClaimFailed, match="became a reduce-scatter"):
        check_sequence_parallel(_tp(sp_forward={"all_reduce": 4}), on_gpu=False)


# --------------------------------------------------------------------------- #
# 10: data (course_utils.checks.data)
# --------------------------------------------------------------------------- #
def test_the_workers_rule_passes_where_it_held_and_fails_where_one_worker_fewer_kept_up():
    from course_utils.checks import check_workers_rule

    compute = {"worker_ms / 0.8": 12.5, "worker_ms / 1.6": 6.25, "worker_ms / 3.2": 3.125}
    au = {"worker_ms / 0.8": {0: 0.4, 1: 0.95, 2: 0.97, 4: 0.97},  # the rule: 1 worker
          "worker_ms / 1.6": {0: 0.3, 1: 0.6, 2: 0.93, 4: 0.95},  # 2
          "worker_ms / 3.2": {0: 0.2, 1: 0.3, 2: 0.6, 4: 0.9}}
    check_workers_rule(au, compute, 10.0, 0.2, (0, 1, 2, 4), cores=3, expected=0.9)
    au["worker_ms / 1.6"][1] = 0.95  # one worker kept up where the rule asked for two
    with pytest.raises(ClaimFailed, match="one worker fewer"):
        check_workers_rule(au, compute, 10.0, 0.2, (0, 1, 2, 4), cores=3, expected=0.9)


def test_webdataset_that_dealt_even_counts_fails_the_whole_shards_claim():
    from course_utils.checks import check_webdataset

    drawn = {r: [f"k{i}" for i in range(341)] for r in range(3)}
    check_webdataset(True, {0: 512, 1: 256, 2: 256}, drawn, 1024, 341)
    with pytest.raises(ClaimFailed, match="whole shards"):
        check_webdataset(True, {0: 341, 1: 341, 2: 341}, drawn, 1023, 341)  # even: not whole shards


# --------------------------------------------------------------------------- #
# 11: when things go wrong (course_utils.checks.debugging)
# --------------------------------------------------------------------------- #
def test_the_hang_named_by_the_records_passes_and_records_that_blame_rank_0_fail():
    from types import SimpleNamespace

    from course_utils.checks import check_hang

    hang = SimpleNamespace(returncode=1, output="")
    records = {0: [{"seq": 2, "op": "all_reduce", "where": "faulty_ddp.py:80"},
                   {"seq": 3, "op": "all_reduce", "where": "faulty_ddp.py:80"}],
               1: [{"seq": 2, "op": "all_reduce", "where": "faulty_ddp.py:80"}]}
    check_hang(hang, records)
    with pytest.raises(ClaimFailed, match="rank 1's record stops"):
        check_hang(hang, {0: records[1], 1: records[0]})


def test_save_modes_where_the_barrier_did_not_move_the_wait_fail():
    from types import SimpleNamespace

    from course_utils.checks import check_save_modes

    said = {"plain": ["rank 1: step 3 failed: Timed out", "rank 0: stopped by the launcher at faulty_ddp.py:120; ..."],
            "barrier": ["rank 1: step 2 failed: Timed out"], "background": []}
    ended = {"background": SimpleNamespace(returncode=0)}
    check_save_modes(said, ended, [0.01, 0.02], 120, 5)
    with pytest.raises(ClaimFailed, match="in the barrier"):
        check_save_modes({**said, "barrier": ["rank 1: step 3 failed: Timed out"]}, ended, [0.01], 120, 5)


def test_step_peaks_without_the_optimizers_state_fail():
    from course_utils.checks import check_step_peaks

    est = {64: [{"peak": {"optimizer": 0}, "peak_total": 100e6}, {"peak": {"optimizer": 89e6}, "peak_total": 189e6}]}
    check_step_peaks(est, 89e6, batches=(64,))
    est[64][1]["peak_total"] = 110e6
    with pytest.raises(ClaimFailed, match="step 2 peaks higher"):
        check_step_peaks(est, 89e6, batches=(64,))


def test_a_ring_that_sent_more_or_less_than_its_blocks_fails():
    from course_utils.checks import check_ring_traffic

    theory = {"forward": 32_768, "backward": 98_304}  # one layer's K and V blocks, 2 ranks
    check_ring_traffic({"forward": 65_536.0, "backward": 196_608.0}, theory, layers=2)
    for sent, claim in (({"forward": 98_304.0, "backward": 196_608.0}, "forward"),  # a block sent once too often
                        ({"forward": 65_536.0, "backward": 131_072.0}, "backward")):  # gradients not taken home
        with pytest.raises(ClaimFailed, match=claim):
            check_ring_traffic(sent, theory, layers=2)


def test_a_balancing_loss_that_left_the_load_as_skewed_fails_and_so_does_a_dispatch_that_sent_its_own_rows():
    from course_utils.checks import check_all_to_all_traffic, check_balancing_loss

    plain = [[442, 524, 571, 511], [180, 720, 300, 848], [157, 960, 191, 740]]  # assignments per expert, steps 1-3
    balanced = [[442, 524, 571, 511], [400, 600, 400, 648], [500, 560, 480, 508]]
    check_balancing_loss(plain, balanced, last=2)
    with pytest.raises(ClaimFailed, match="with it"):  # the loss added nothing: the load as skewed
        check_balancing_loss(plain, plain, last=2)
    with pytest.raises(ClaimFailed, match="step 1"):  # runs that did not start from the same router
        check_balancing_loss(plain, [[512, 512, 512, 512], *balanced[1:]], last=2)
    with pytest.raises(ClaimFailed, match="every step's assignments"):  # a run that dropped assignments
        check_balancing_loss(plain, [balanced[0], [400, 600, 400, 600], balanced[2]], last=2)
    check_all_to_all_traffic({"dispatch": 115_541.0, "combine": 41_643.0}, 115_541.0)
    with pytest.raises(ClaimFailed, match="exactly the rows"):  # rank 0's own experts' rows sent too
        check_all_to_all_traffic({"dispatch": 115_541.0 + 12_288, "combine": 41_643.0}, 115_541.0)


def test_a_context_split_that_kept_every_rank_s_activations_whole_fails():
    from course_utils.checks import check_cp_activations

    lengths = [64, 128, 256]
    measured = {1: [6.84, 13.26, 26.11], 2: [3.63, 6.81, 13.15], 4: [1.85, 3.62, 6.81]}
    check_cp_activations(measured, lengths)
    with pytest.raises(ClaimFailed, match="CP = 4"):  # ranks that each kept the whole sequence's activations
        check_cp_activations({**measured, 4: measured[1]}, lengths)
    with pytest.raises(ClaimFailed, match="grow with the sequence"):  # a count that missed the per-token tensors
        check_cp_activations({1: [6.84, 7.0, 7.2], 2: [3.5, 3.6, 3.7]}, lengths)


def test_a_shuffle_buffer_that_mixed_nothing_or_mixed_as_much_when_small_fails():
    from course_utils.checks.data import check_shuffle_buffer

    check_shuffle_buffer({0: [1, 1, 2], 51: [2, 3, 2], 1000: [8, 9, 8]}, 51, 1000, run=102)
    with pytest.raises(ClaimFailed, match="mixes the classes"):  # a buffer that emitted in the order it read
        check_shuffle_buffer({0: [1, 1, 2], 51: [1, 1, 2], 1000: [1, 2, 2]}, 51, 1000, run=102)
    with pytest.raises(ClaimFailed, match="mixes less"):  # a small buffer drawing from the whole reader's share
        check_shuffle_buffer({0: [1, 1, 2], 51: [8, 9, 8], 1000: [8, 9, 8]}, 51, 1000, run=102)


def test_plain_fabric_must_print_plain_ddp_s_losses():
    from types import SimpleNamespace

    from course_utils.checks import check_plain_fabric

    def run(losses, identical=True):
        lines = [f"epoch {e}: loss {loss:.4f} (8 steps of 2 x 64 images on 2 ranks); held-out loss 2.0, accuracy 10.0%"
                 for e, loss in enumerate(losses)]
        return SimpleNamespace(output="\n".join([*lines, f"done: 2 ranks, 2 per node; weights identical on every rank: "
                                                            f"{identical}"]))

    check_plain_fabric(run([2.5, 2.1]), run([2.5, 2.1]), 2, exact=True)
    check_plain_fabric(run([2.5, 2.1]), run([2.51, 2.11]), 2, exact=False)  # mixed precision: within 2%
    for ddp, fabric, exact, claim in ((run([2.5, 2.1]), run([2.5, 2.1001]), True, "losses, to the printed digit"),
                                      (run([2.5, 2.1]), run([2.5, 2.3]), False, "within 2%"),
                                      (run([2.5, 2.1]), run([2.5, 2.1], identical=False), True, "identical weights"),
                                      (run([2.5, 2.6]), run([2.5, 2.6]), True, "the loss fell")):
        with pytest.raises(ClaimFailed, match=claim):
            check_plain_fabric(ddp, fabric, 2, exact=exact)


def test_plain_fsdp_must_print_plain_ddp_s_losses_resume_and_shard():
    from types import SimpleNamespace

    from course_utils.checks import check_plain_fsdp

    def run(losses, first_epoch=0, resumed=False, shares="[10245, 10245] of 20490"):
        lines = ([f"resumed from runs/ck/epoch-{first_epoch}"] if resumed else []) + [
            f"epoch {e}: loss {loss:.4f} (8 steps of 2 x 64 images on 2 ranks); held-out loss 2.0, accuracy 10.0%"
            for e, loss in enumerate(losses, start=first_epoch)]
        return SimpleNamespace(output="\n".join([*lines, f"done: 2 ranks, 2 per node; parameters held per rank: {shares}"]))

    ddp = SimpleNamespace(output=run([2.5, 2.1, 1.9]).output)
    check_plain_fsdp(ddp, run([2.5, 2.1]), run([1.9], 2, resumed=True), ranks=2, exact=True)
    check_plain_fsdp(ddp, run([2.51, 2.1]), run([1.91], 2, resumed=True), ranks=2, exact=False)  # bf16: within 2%
    for first, again, exact, claim in (
            (run([2.5, 2.1]), run([1.9001], 2, resumed=True), True, "to the printed digit"),
            (run([2.5, 2.1]), run([2.1], 2, resumed=True), False, "within 2%"),
            (run([2.5, 2.1]), run([2.5, 2.1, 1.9]), True, "losses"),  # trained again from the start: six epochs
            (run([2.5, 2.1]), run([1.9], 2), True, "resumed from its DCP checkpoint"),
            (run([2.5, 2.1]), run([1.9], 2, resumed=True, shares="[20490, 20490] of 20490"), True, "each a part"),
            (run([2.5, 2.1]), run([1.9], 2, resumed=True, shares="[10245, 10244] of 20490"), True, "together")):
        with pytest.raises(ClaimFailed, match=claim):
            check_plain_fsdp(ddp, first, again, ranks=2, exact=exact)
