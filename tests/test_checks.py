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
    ("loop by hand", {"global_step": 11}, "the same 12 optimiser steps"),
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
