"""The hardware label that every measured number in the notebooks carries."""
import torch

from course_utils.hardware import environment_report, hardware_label

REPORT = {"cpu": "Xeon Gold 6326", "cores_usable": 2, "gpus": [{"name": "NVIDIA A100-PCIE-40GB"}]}


def test_the_label_names_what_ran_the_numbers():
    assert hardware_label(REPORT, "cuda") == "NVIDIA A100-PCIE-40GB"
    assert hardware_label(REPORT, "cuda", ranks=2, backend="nccl") == "2 x NVIDIA A100-PCIE-40GB, nccl"
    # several CPU ranks share the cores the process may use: the label gives those, not a rank count
    assert hardware_label(REPORT, "cpu", ranks=3, backend="gloo") == "CPU Xeon Gold 6326 (2 cores), gloo"


def test_the_label_of_this_machine_comes_from_its_report():
    report = environment_report()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    label = hardware_label(report, device)
    assert (report["gpus"][0]["name"] if report["gpus"] else report["cpu"]) in label
