"""tune.py's bad inputs, each one line within seconds (Ray itself would wait for minutes or for ever).
Notebook 08 runs the searches; the Ray pattern's test on the Slurm cluster runs tune.py across nodes."""

import pytest
import torch

from course_utils.launch import LaunchError, run_script
from course_utils.tuning import trials_per_node, unfit_ddp_trial, unfit_request

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_a_request_no_node_can_hold_is_named_with_the_largest_node():
    nodes = [{"CPU": 16, "GPU": 0}, {"CPU": 16, "GPU": 0}]
    assert unfit_request(8, 0, nodes) is None
    why = unfit_request(32, 0, nodes)
    assert why and "asks for 32 CPUs" in why and "has 16 CPUs and 0 GPUs" in why
    assert unfit_request(4, 1, nodes) and unfit_request(4, 0.5, [{"CPU": 64, "GPU": 2}]) is None


def test_a_ddp_trial_whose_workers_do_not_all_fit_at_once_is_named():
    """Each worker fits a node, the trial does not: Ray Train would wait for its workers for ever."""
    ft3_job = [{"CPU": 64, "GPU": 2}, {"CPU": 64, "GPU": 2}]
    assert unfit_ddp_trial(4, 8, 1, ft3_job) is None  # 4 GPUs in two nodes
    why = unfit_ddp_trial(2, 4, 1, [{"CPU": 8, "GPU": 1}])  # a 1-GPU portal node
    assert why and "2 workers, each 4 CPUs and 1 GPUs" in why and "8 CPUs + 1 GPUs" in why, why
    assert unfit_ddp_trial(4, 8, 1, ft3_job[:1]) and unfit_ddp_trial(2, 8, 1, ft3_job[:1]) is None


def test_fractions_of_a_gpu_are_counted_as_ray_counts_them():
    """Ray's units are 1/10000: five trials of 0.2 GPU share a GPU (float division says 1 // 0.2 == 4)."""
    assert [trials_per_node(64, 1, 1, g) for g in (0.2, 0.1, 0.4, 0.5, 1)] == [5, 10, 2, 2, 1]
    assert trials_per_node(1, 0, 0.1, 0) == 10


@pytest.mark.parametrize("flags, says", [
    (["--address", "127.0.0.1:9"], "no Ray is listening at 127.0.0.1:9"),
    (["--gpus-per-trial", "1"], "and the largest of the 1 Ray node(s) has"),
    (["--scheduler", "pbt", "--searcher", "optuna"], "scheduler pbt runs single-process trials drawn at random"),
    (["--workers-per-trial", "64"], "a DDP trial of 64 workers, each 1 CPUs and 0 GPUs, fits nowhere"),
], ids=["address-where-no-ray-listens", "gpus-per-trial-without-a-gpu", "pbt-with-tpe", "ddp-trial-too-big"])
def test_tune_stops_in_one_line(flags, says, tmp_path):
    if "--gpus-per-trial" in flags and torch.cuda.device_count():
        pytest.skip("this machine has a GPU: a trial of one GPU fits")
    with pytest.raises(LaunchError) as refused:
        run_script("tune.py", [*flags, "--num-samples", "1", "--storage", str(tmp_path)], env=ONE_THREAD,
                   timeout_s=60, echo=False)
    out = refused.value.result.output
    assert says in out and out.strip().splitlines()[-1].startswith("error: ") and "Traceback" not in out, out


def test_a_trial_s_history_survives_ray_s_json_log_losing_reports(tmp_path):
    """Ray 2.60's JSON logger copies the storage's older result.json over its own when a trial starts
    again (a PBT pause): the reports in progress.csv are the trial's history (notebook 08 failed on it)."""
    import csv
    import json

    from ray.tune import Result

    from course_utils.tuning import history

    reports = [{"epoch": e, "lr": 0.01 * e, "training_iteration": e, "trial_id": "00001"} for e in (1, 2, 3, 4)]
    (tmp_path / "params.json").write_text(json.dumps({"lr": 0.01}))
    (tmp_path / "result.json").write_text(json.dumps(reports[0]) + "\n")  # what Ray left after a resume
    with open(tmp_path / "progress.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, reports[0].keys())
        writer.writeheader()
        writer.writerows(reports)
    result = Result.from_path(tmp_path)
    assert len(result.metrics_dataframe) == 1, "Ray reads result.json first"
    frame = history(result)
    assert frame["epoch"].tolist() == [1, 2, 3, 4] and frame["trial_id"].tolist() == ["00001"] * 4
    (tmp_path / "progress.csv").unlink()
    assert history(Result.from_path(tmp_path))["epoch"].tolist() == [1], "without the CSV: what the JSON holds"


def test_tunes_noise_is_held_back_during_a_search_and_the_levels_put_back_after():
    """The notebook's output holds the lesson: Tune's notes to a notebook, PBT's "Remote file not found" and an
    interrupted search's "Failed to fetch metrics" are held back while a search runs, and only then."""
    import logging

    from course_utils.tuning.search import _QUIET, _quiet_tune

    pbt_restore = logging.getLogger("ray.tune.logger.logger")
    pbt_restore.setLevel(logging.DEBUG)
    with _quiet_tune():
        assert not pbt_restore.isEnabledFor(logging.WARNING)
        assert all(logging.getLogger(name).level == level for name, level in _QUIET.items())
    assert pbt_restore.level == logging.DEBUG and pbt_restore.isEnabledFor(logging.WARNING)
    pbt_restore.setLevel(logging.NOTSET)


def test_a_failed_trial_is_logged_in_one_line_during_a_search_with_its_traceback_after_it(caplog):
    """Tune logs each failed attempt with Ray's whole traceback; during a search it is one line: the trial and
    the error's last line. Outside a search the record is Tune's own."""
    import logging

    from course_utils.tuning.search import _quiet_tune

    controller = logging.getLogger("ray.tune.execution.tune_controller")

    def fail() -> None:
        try:
            raise RuntimeError("ray::ImplicitFunc.train()\n  frames ...\nRuntimeError: fail_at_epoch 2")
        except RuntimeError as exc:
            controller.error("Trial task failed for trial tune_trial_0", exc_info=exc)

    with caplog.at_level(logging.ERROR, logger=controller.name):
        with _quiet_tune():
            fail()
        fail()
    during, after = caplog.records
    assert during.getMessage() == "Trial task failed for trial tune_trial_0: RuntimeError: fail_at_epoch 2"
    assert during.exc_info is None and after.exc_info is not None, "the filter is gone after the search"
