"""TrainConfig is the one source of training knobs: the command line, config files and the
flags notebooks hand to train.py all come from its fields, and a checkpoint says which
configuration wrote it."""

import argparse
import dataclasses

import pytest
import torch

from course_utils import data
from course_utils.checkpoint import CheckpointError, previous_path
from course_utils.config import (
    TrainConfig,
    add_config_args,
    changes,
    config_flags,
    config_from_args,
    resume_mismatch,
)
from course_utils.launch import run_script
from course_utils.models import build_model
from course_utils.trainer import Trainer


def parse(argv):
    parser = argparse.ArgumentParser()
    add_config_args(parser)
    return config_from_args(parser.parse_args([str(a) for a in argv]))


def test_every_field_has_a_flag_and_no_flags_give_the_defaults():
    """Every knob is a flag of scripts/train_lm.py (all groups); the image scripts leave out the transformer's."""
    from course_utils.config import GROUPS

    def dests(*groups):
        parser = argparse.ArgumentParser()
        add_config_args(parser, *groups)
        return {a.dest for a in parser._actions}

    names = {f.name for f in dataclasses.fields(TrainConfig)}
    transformer = {f.name for f in dataclasses.fields(TrainConfig) if f.metadata.get("group") == "transformer"}
    assert names <= dests(GROUPS)
    assert names - dests() == transformer and {"seq_len", "tp", "dp_shard"} <= transformer
    assert parse([]) == TrainConfig()


def test_flags_round_trip_through_config_flags():
    wanted = TrainConfig(model="cnn-gn", epochs=3, lr=0.2, precision="amp", tf32=False, channels_last=True,
                         workers=0, steps_per_epoch=7, progress=False, ckpt_dir="/tmp/x")
    flags = config_flags(wanted)
    assert "--no-tf32" in flags and "--no-progress" in flags and "--channels-last" in flags
    assert parse(flags) == wanted
    # what a run's summary lists: exactly the fields set above (each differs from its default)
    assert changes(wanted) == {"model": "cnn-gn", "epochs": 3, "lr": 0.2, "precision": "amp", "tf32": False,
                               "channels_last": True, "workers": 0, "steps_per_epoch": 7, "progress": False,
                               "ckpt_dir": "/tmp/x"}


def test_a_config_file_sets_fields_and_flags_override_it(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('model = "cnn-gn"\nepochs = 5\n[speed]\nprecision = "bf16"\nchannels_last = true\n')
    cfg = parse(["--config", path, "--epochs", "2"])
    assert (cfg.model, cfg.epochs, cfg.precision, cfg.channels_last) == ("cnn-gn", 2, "bf16", True)
    assert cfg.lr == TrainConfig().lr


@pytest.mark.parametrize("text, message", [
    ("modell = 'cnn'\n", "unknown setting 'modell'"),
    ("epochs = 'two'\n", "epochs takes an int"),
    ("epochs = 0\n", "epochs must be >= 1"),
    ("precision = 'fp8'\n", "precision must be one of"),
    ("compile = 1\n", "compile takes true or false"),
    ("epochs = \n", "not valid TOML"),
])
def test_a_bad_config_file_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as err:
        parse(["--config", path])
    assert str(path) in str(err.value)


def test_train_script_reads_a_config_file(tmp_path):
    path = tmp_path / "quick.toml"
    path.write_text("epochs = 1\nworkers = 0\nn_train = 256\nn_val = 64\nbatch_size = 32\nlr = 0.07\n")
    run = run_script("train.py", ["--config", path, "--batch-size", "64"], echo=False, timeout_s=300)
    assert "global batch 64, lr 0.07" in run.output


def test_resume_mismatch_names_the_fields_that_must_match():
    saved = dataclasses.asdict(TrainConfig(model="cnn", batch_size=32, precision="fp32", epochs=1))
    now = TrainConfig(model="cnn", batch_size=64, precision="bf16", epochs=3, workers=0)
    assert resume_mismatch(saved, now) == ["batch_size 32 -> 64", "precision 'fp32' -> 'bf16'"]
    assert resume_mismatch({"model": "cnn"}, TrainConfig()) == [], "fields an older checkpoint lacks are not compared"


def small_trainer(ckpt, **cfg):
    train, _, _ = data.get_datasets("synthetic", n_train=128, n_val=16, augment=False)
    torch.manual_seed(0)
    config = TrainConfig(epochs=cfg.pop("epochs", 1), progress=False, ckpt_dir=str(ckpt), workers=0, **cfg)
    return Trainer(build_model(config.model), data.make_loader(train, 32, seed=0), "cpu", config)


def test_resuming_with_another_configuration_stops_with_one_line(tmp_path):
    small_trainer(tmp_path).fit()
    with pytest.raises(CheckpointError, match=r"another configuration \(model 'cnn' -> 'cnn-gn'\)"):
        small_trainer(tmp_path, epochs=2, model="cnn-gn")
    assert small_trainer(tmp_path, epochs=2, log_every=3).epoch == 1, "a change that is safe still resumes"


def test_a_corrupt_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    small_trainer(tmp_path).fit()
    small_trainer(tmp_path, epochs=2).fit()  # its save keeps epoch 1's checkpoint as last.prev.pt
    last = tmp_path / "last.pt"
    assert torch.load(previous_path(last), weights_only=False)["epoch"] == 1
    last.write_bytes(last.read_bytes()[: last.stat().st_size // 2])  # a copy cut short
    resumed = small_trainer(tmp_path, epochs=3)
    out = capsys.readouterr().out
    assert "last.pt is unreadable" in out and "resuming from the checkpoint before it" in out
    assert resumed.epoch == 1
    previous_path(last).unlink()
    with pytest.raises(CheckpointError, match="last.pt is unreadable"):
        small_trainer(tmp_path, epochs=3)


def test_train_script_turns_a_checkpoint_it_cannot_resume_into_one_line(tmp_path):
    """Both refusals above (another configuration, an unreadable checkpoint) are CheckpointErrors, which
    train.py turns into one line and exit status 2; one script run shows it (no training needed first)."""
    (tmp_path / "last.pt").write_bytes(b"\x00" * 100)
    args = ["--epochs", 1, "--workers", 0, "--n-train", 128, "--n-val", 32, "--ckpt-dir", tmp_path]
    broken = run_script("train.py", args, check=False, echo=False, timeout_s=300)
    assert broken.returncode == 2 and "Traceback" not in broken.output
    last = broken.output.strip().splitlines()[-1]
    assert last.startswith(f"error: the checkpoint {tmp_path / 'last.pt'} is unreadable") and "delete it" in last, last


def test_the_committed_config_files_are_valid():
    from course_utils.config import load_config_file
    from course_utils.paths import REPO_ROOT

    files = sorted((REPO_ROOT / "configs").glob("*.toml"))
    assert files, "configs/ holds the example config files"
    for path in files:
        settings = load_config_file(path)  # raises on an unknown setting or a bad value
        assert settings, f"{path} sets nothing"
        assert parse(["--config", path]) == parse(config_flags(TrainConfig(**settings))), \
            "a file and the flags it stands for are the same run"


def test_in_a_course_slurm_job_the_outputs_default_to_its_folder():
    """slurm/lib/course_job.sh exports RUN_DIR; the course's scripts put their outputs there unless told otherwise."""
    from course_utils.config import in_run_dir

    job = {"RUN_DIR": "/scratch/runs/ft3-requeue-7", "SLURM_JOB_ID": "7"}
    cfg = in_run_dir(TrainConfig(), environ=job)
    assert (cfg.ckpt_dir, cfg.log_dir) == ("/scratch/runs/ft3-requeue-7/ckpt", "/scratch/runs/ft3-requeue-7/tb")
    assert in_run_dir(TrainConfig(), logs=False, environ=job).log_dir is None, "a script that writes no logs"
    mine = in_run_dir(TrainConfig(ckpt_dir="/mine"), environ=job)
    assert mine.ckpt_dir == "/mine" and mine.log_dir.endswith("/tb"), "a --ckpt-dir of your own wins"
    assert in_run_dir(TrainConfig(), environ={"RUN_DIR": "/somewhere"}) == TrainConfig(), "outside a Slurm job"
