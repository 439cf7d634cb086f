"""tune.py's bad inputs, each one line within seconds (Ray itself would wait for minutes or for ever).
Notebook 08 runs the searches; the Ray pattern's test on the Slurm cluster runs tune.py across nodes."""

import pytest
import torch

from course_utils.launch import LaunchError, run_script
from course_utils.tuning import unfit_request

ONE_THREAD = {"OMP_NUM_THREADS": "1"}


def test_a_request_no_node_can_hold_is_named_with_the_largest_node():
    nodes = [{"CPU": 16, "GPU": 0}, {"CPU": 16, "GPU": 0}]
    assert unfit_request(8, 0, nodes) is None
    why = unfit_request(32, 0, nodes)
    assert why and "asks for 32 CPUs" in why and "has 16 CPUs and 0 GPUs" in why
    assert unfit_request(4, 1, nodes) and unfit_request(4, 0.5, [{"CPU": 64, "GPU": 2}]) is None


@pytest.mark.parametrize("flags, says", [
    (["--address", "127.0.0.1:9"], "no Ray is listening at 127.0.0.1:9"),
    (["--gpus-per-trial", "1"], "and the largest of the 1 Ray node(s) has"),
    (["--scheduler", "pbt", "--searcher", "optuna"], "scheduler pbt runs single-process trials drawn at random"),
], ids=["address-where-no-ray-listens", "gpus-per-trial-without-a-gpu", "pbt-with-tpe"])
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
