"""Tensor parallelism's sharded checkpoints (scripts/train_tp.py --ckpt-dir). Notebook 09 runs the
pipeline, tensor-parallel, 2-D and RPC scripts and checks what they teach; the test Slurm cluster runs
the 2-D pattern (tests/test_slurm.py). What no notebook shows: stopping a tensor-parallel run and resuming it,
and the parameter server's forward pass under RPC's concurrent threads."""

import sys
import threading

import pytest
import torch

from course_utils.launch import run_script, start_script
from course_utils.paths import SCRIPTS
from course_utils.results import parse_result

sys.path.insert(0, str(SCRIPTS))
import rpc_param_server  # noqa: E402

TINY = ["--hidden", "32", "--heads", "2", "--blocks", "1", "--batch", "2", "--seq", "8", "--tp-size", "2",
        "--device", "cpu"]
ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def _start(*args):
    return start_script("train_tp.py", [*TINY, *args], nproc=2, env=ONE_THREAD)


def _result(job):
    return parse_result(job.wait(timeout_s=180).output)


def test_a_tensor_parallel_run_resumed_from_its_sharded_checkpoint_ends_where_an_unstopped_run_ends(tmp_path):
    """Two tensor-parallel ranks, SGD with momentum: each rank writes its own shards of the weights and
    of the momentum (torch.distributed.checkpoint) after step 2; the next run reads them and trains
    steps 3 and 4 with exactly the losses of a run that never stopped."""
    straight, first = _start("--steps", "4"), _start("--steps", "2", "--ckpt-dir", str(tmp_path))  # at once
    straight, first = _result(straight), _result(first)
    second = _result(_start("--steps", "4", "--ckpt-dir", str(tmp_path)))
    assert (tmp_path / "latest").read_text() == "step-4" and not (tmp_path / "step-2").exists()
    assert first["resumed_from"] is None and second["resumed_from"] == 2
    assert first["losses"] + second["losses"] == straight["losses"], (first, second, straight)
    assert second["train_loss_gap"] <= 1e-5, "the unsplit blocks, checkpointed beside, still agree"


def test_a_damaged_sharded_checkpoint_is_one_error_that_names_it_and_says_what_to_do(one_rank_group, tmp_path, caplog):
    """The step folder ``latest`` names holds junk metadata (a copy cut short): train_tp.py, train_fsdp.py and
    train_pipeline.py (the same load_sharded) stop with one line, instead of DCP's UnpicklingError and
    FileNotFoundError tracebacks printed by every rank."""
    from course_utils.checkpoint import CheckpointError
    from course_utils.checkpoint import latest_sharded, load_sharded

    (tmp_path / "step-2").mkdir()
    (tmp_path / "step-2" / ".metadata").write_bytes(b"not a pickle")
    (tmp_path / "latest").write_text("step-2")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(CheckpointError, match=f"{tmp_path / 'step-2'} cannot be read.*Remove {tmp_path / 'latest'}"):
        load_sharded(latest_sharded(tmp_path), model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert not [r for r in caplog.records if r.exc_info], "no rank logs a traceback on the way (DCP's warnings do)"


def test_a_schedule_asked_for_fewer_micro_batches_than_it_can_run_is_refused_before_any_work():
    import train_pipeline

    refused, _ = train_pipeline.microbatch_plan(["gpipe", "1f1b"], [2], stages=3)
    assert refused == "1f1b needs at least 3 micro-batches for 3 stages: --microbatches 3 or more"
    assert train_pipeline.microbatch_plan(["1f1b"], [2, 4], stages=3) == (None, ["1f1b: m < 3 left out (1f1b needs "
                                                                                   "a micro-batch per stage, 3 stages)"])


PIPELINE_RUN = ["--model", "mlp", "--n-train", "512", "--n-val", "256", "--batch-size", "64", "--workers", "0",
                "--device", "cpu", "--no-progress"]


def test_the_pipelined_run_is_train_py_s_run_and_resumes_from_its_sharded_checkpoint(tmp_path):
    """train_pipeline.py --train: the course's mlp dealt to 2 stages, 4 micro-batches per batch through
    1F1B. Epoch 1 is trained, checkpointed (each rank its stage: torch.distributed.checkpoint), and
    resumed for epoch 2; the two epochs' losses and the final validation are those of train.py in one
    process, and the checkpoint is the whole model's, loadable without any pipeline."""
    import torch

    from course_utils.models import build_model
    from course_utils.checkpoint import consolidate_sharded

    single = start_script("train.py", [*PIPELINE_RUN, "--epochs", "2"], nproc=1, env=ONE_THREAD)  # beside the first

    def pipelined(epochs):
        return parse_result(run_script("train_pipeline.py", ["--train", *PIPELINE_RUN, "--epochs", str(epochs),
                                                             "--ckpt-dir", str(tmp_path)],
                                       nproc=2, env=ONE_THREAD, timeout_s=180, echo=False).output)

    first = pipelined(1)
    single = parse_result(single.wait(timeout_s=180).output)
    second = pipelined(2)
    assert first["resumed_from"] is None and second["resumed_from"] == str(tmp_path / "step-8")
    assert first["units"] == [["stem", "blocks.0"], ["blocks.1", "blocks.2", "head"]]
    assert second["train_loss"][:1] == first["train_loss"]
    assert second["train_loss"] == pytest.approx(single["train_loss"], rel=1e-5), (second, single)
    assert second["val_loss"] == pytest.approx(single["val_loss"], rel=1e-5)
    whole = consolidate_sharded(tmp_path / "step-16", tmp_path / "whole.pt")
    build_model("mlp", 3, 10).load_state_dict(whole, strict=True)  # every parameter, under the model's own names
    assert all(torch.isfinite(t).all() for t in whole.values())


def test_the_parameter_server_keeps_its_parameters_when_trainers_call_its_forward_at_once():
    # RPC serves each trainer's call on a thread of its pool. A forward pass that let two threads swap
    # tensors into the shared module at once left it holding a trainer's clones: the optimizer then
    # stepped parameters the model no longer used (a CI run's server stopped learning).
    server = rpc_param_server.ParameterServer()
    params = list(server.model.parameters())

    def trainer(rank):
        for step in range(300):
            server.forward(rank, rpc_param_server.teacher_batch(4, seed=step)[0])

    threads = [threading.Thread(target=trainer, args=(rank,)) for rank in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert server.steps == {1: 300, 2: 300}
    assert all(a is b for a, b in zip(server.model.parameters(), params, strict=True)), \
        "the model must still hold the parameters the distributed optimizer steps"
    assert all(isinstance(p, torch.nn.Parameter) for p in server.model.parameters())


def _timed_under_stream_waits(rank: int, init: str, results) -> None:
    """One stage of train_pipeline.py's timed step, on gloo made to wait as NCCL does: a p2p ``wait()``
    returns at once and only orders the (here absent) stream; the transfer completes when the stream
    is synchronised, which is what ``pipeline.block_until_ready`` does on a GPU."""
    import torch.distributed as dist
    from torch.distributed.pipelining import schedules

    from course_utils import pipeline

    import train_pipeline

    on_the_stream: list = []
    schedules._wait_batch_p2p = lambda works: on_the_stream.extend(works or [])  # NCCL: the CPU goes on

    def stream_synchronize(x):
        while on_the_stream:
            on_the_stream.pop().wait()

    pipeline.block_until_ready = stream_synchronize
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    torch.set_num_threads(1)
    try:
        for m in (1, 4):
            seconds = train_pipeline.time_schedule("gpipe", m, rank, 2, 16, 0.05, torch.device("cpu"))["step_s"]
            stream_synchronize(None)
            step = [None, None]
            dist.all_gather_object(step, seconds)
            results[(rank, m)] = 1 - m * 3 * 0.05 / max(step)
    finally:
        dist.destroy_process_group()


def test_the_measured_bubble_holds_when_a_collectives_wait_does_not_block_the_cpu(tmp_path):
    """Under NCCL, a received activation's ``Work.wait()`` does not block the CPU. The simulated compute
    then waits for its input itself, so two GPipe stages still measure the bubble (p-1)/(m+p-1): 0.5
    with one micro-batch, 0.2 with four (without that wait the stages' sleeps overlap: about 0)."""
    import torch.multiprocessing as mp

    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_timed_under_stream_waits, args=(f"file://{tmp_path / 'store'}", results), nprocs=2,
                           start_method="spawn")
        bubble = {m: results[(0, m)] for m in (1, 4)}
    assert 0.5 - 0.05 <= bubble[1] <= 0.5 + 0.1 and 0.2 - 0.05 <= bubble[4] <= 0.2 + 0.1, bubble
