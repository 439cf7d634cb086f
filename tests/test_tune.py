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
