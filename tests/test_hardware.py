"""The hardware label that every measured number in the notebooks carries."""
from course_utils.hardware import environment_report, hardware_label

REPORT = {"cpu": "Xeon Gold 6326", "cores_usable": 2, "gpus": [{"name": "NVIDIA A100-PCIE-40GB"}]}


def test_the_label_names_what_ran_the_numbers():
    assert hardware_label(REPORT, "cuda") == "NVIDIA A100-PCIE-40GB"
    assert hardware_label(REPORT, "cuda", ranks=2, backend="nccl") == "2 x NVIDIA A100-PCIE-40GB, nccl"
    # several CPU ranks share the cores the process may use: the label gives those, not a rank count
    assert hardware_label(REPORT, "cpu", ranks=3, backend="gloo") == "CPU Xeon Gold 6326 (2 cores), gloo"


def test_the_label_of_this_machine_names_its_cpu_and_the_cores_this_process_may_use():
    """Read against the machine itself (/proc/cpuinfo, the affinity mask), not against the report."""
    import os

    with open("/proc/cpuinfo") as fh:
        model = next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    label = hardware_label(environment_report(), "cpu")
    assert label == f"CPU {model} ({len(os.sched_getaffinity(0))} cores)"
