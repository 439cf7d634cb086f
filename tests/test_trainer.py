"""The training loop: loss falls, accumulation is exact, logs are real, resume continues."""

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from course_utils import data
from course_utils.events import scalars
from course_utils.models import build_model, count_parameters
from course_utils.precision import resolve_precision
from course_utils.trainer import TrainConfig, Trainer


def _linear_problem(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    y = (x[:, :4].sum(1) > 0).long()
    return TensorDataset(x, y)


def _linear_trainer(batch, accum, tmp_path=None, **cfg):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    loader = DataLoader(_linear_problem(), batch_size=batch, shuffle=False)
    config = TrainConfig(epochs=1, lr=0.1, momentum=0.0, weight_decay=0.0, grad_accum=accum,
                         progress=False, **cfg)
    return Trainer(model, loader, "cpu", config)


def test_each_trainer_sets_the_process_s_math_switches_to_its_settings():
    """TF32 and cuDNN's algorithm search are one value per process: a Trainer sets both from its settings, and
    the next one's replace them (notebook 01's ladder builds a Trainer per rung)."""
    from course_utils.precision import tf32_state

    try:
        _linear_trainer(batch=8, accum=1, cudnn_benchmark=True, tf32=True)
        assert torch.backends.cudnn.benchmark and tf32_state()["matmul"]
        _linear_trainer(batch=8, accum=1)  # the defaults: no algorithm search, PyTorch's TF32 defaults
        assert not torch.backends.cudnn.benchmark and not tf32_state()["matmul"]
    finally:
        torch.backends.cudnn.benchmark = False


def test_gradient_accumulation_matches_big_batch():
    big = _linear_trainer(batch=16, accum=1)
    small = _linear_trainer(batch=8, accum=2)
    big.fit()
    small.fit()
    assert big.global_step == small.global_step == 4
    for a, b in zip(big.raw_model.parameters(), small.raw_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_loss_falls_and_tensorboard_events_are_real(tmp_path):
    torch.manual_seed(0)
    train, val, info = data.get_datasets("synthetic", n_train=2048, n_val=512)
    trainer = Trainer(
        build_model("cnn"), data.make_loader(train, 64), "cpu",
        TrainConfig(epochs=2, progress=False, log_dir=str(tmp_path / "tb"), log_every=4),
        val_loader=data.make_loader(val, 256, shuffle=False),
    )
    history = trainer.fit()
    assert history[-1].train_loss < history[0].train_loss
    assert trainer.step_losses[-1] < trainer.step_losses[0]
    steps, values = scalars(tmp_path / "tb", "loss/train_step")
    assert len(steps) >= 8 and values[-1] < values[0]
    assert len(scalars(tmp_path / "tb", "epoch/val_acc")[1]) == 2
    with pytest.raises(KeyError, match="holds no scalar 'nope'; it holds: epoch/"):
        scalars(tmp_path / "tb", "nope")


def test_resume_continues_from_last_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first = _linear_trainer(batch=16, accum=1, ckpt_dir=str(ckpt))
    first.fit()
    assert (ckpt / "last.pt").exists()
    # a new process would build the same trainer with more epochs and pick up at epoch 1
    second = _linear_trainer(batch=16, accum=1, ckpt_dir=str(ckpt))
    assert second.epoch == 1 and second.global_step == 4
    for a, b in zip(first.raw_model.parameters(), second.raw_model.parameters()):
        assert torch.equal(a, b)
    second.cfg.epochs = 2
    second.fit()
    assert [h.epoch for h in second.history] == [0, 1]


def test_a_run_resumed_with_another_learning_rate_trains_with_it(tmp_path):
    """Population Based Training resumes a donor's checkpoint with a changed lr: the optimiser's saved
    state must not bring the old one back, also part-way through the warm-up."""
    ckpt = tmp_path / "ckpt"
    _linear_trainer(batch=16, accum=1, ckpt_dir=str(ckpt), warmup_epochs=2).fit()  # 4 of 8 warm-up steps
    same = _linear_trainer(batch=16, accum=1, ckpt_dir=str(ckpt), warmup_epochs=2)
    assert same.optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * 5 / 8)  # the warm-up's 5th step
    torch.manual_seed(0)
    config = TrainConfig(epochs=1, lr=0.4, momentum=0.0, weight_decay=0.0, progress=False, ckpt_dir=str(ckpt),
                         warmup_epochs=2)
    faster = Trainer(nn.Linear(8, 2), DataLoader(_linear_problem(), batch_size=16), "cpu", config)
    assert faster.epoch == 1 and faster.optimizer.param_groups[0]["lr"] == pytest.approx(0.4 * 5 / 8)
    faster.cfg.epochs = 2
    faster.fit()
    assert faster.optimizer.param_groups[0]["lr"] == pytest.approx(0.4)  # the warm-up ended at the new lr


def test_precision_rules():
    cpu = torch.device("cpu")
    assert resolve_precision("fp32", cpu) == "fp32" and resolve_precision("bf16", cpu) == "bf16"
    with pytest.raises(ValueError, match="GPU"):
        resolve_precision("fp16", cpu)
    with pytest.raises(ValueError, match="fp64"):
        resolve_precision("fp64", cpu)


def test_bf16_and_channels_last_train_on_cpu():
    trainer = _linear_trainer(batch=16, accum=1, precision="bf16")
    history = trainer.fit()
    assert torch.isfinite(torch.tensor(history[-1].train_loss))
    cnn = Trainer(
        build_model("cnn"), data.make_loader(data.get_datasets("synthetic", n_train=64, n_val=8)[0], 32),
        "cpu", TrainConfig(epochs=1, channels_last=True, progress=False),
    )
    cnn.fit()
    assert cnn.raw_model.features[0].weight.is_contiguous(memory_format=torch.channels_last)


def test_unwritable_log_dir_fails_before_training(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(PermissionError, match="log folder"):
        _linear_trainer(batch=16, accum=1, log_dir=str(blocker / "tb"))


def test_models_have_expected_sizes():
    assert 11.0e6 < count_parameters(build_model("resnet18")) < 11.5e6
    for channels, size in ((1, 28), (3, 32)):
        for name in ("cnn", "resnet18", "mlp"):
            out = build_model(name, channels)(torch.randn(2, channels, size, size))
            assert out.shape == (2, 10)
    weights = sum(p.numel() for n, p in build_model("mlp").named_parameters() if n.endswith("weight"))
    assert weights / count_parameters(build_model("mlp")) > 0.99, "notebook 07's model: the weights are the memory"


def test_activation_checkpointing_recomputes_the_same_gradients():
    from course_utils.models import enable_activation_checkpointing

    x, grads, calls = torch.randn(4, 3, 32, 32), [], []
    for checkpointed in (False, True):
        torch.manual_seed(0)
        model = build_model("mlp")
        if checkpointed:
            enable_activation_checkpointing(model)
        runs = []
        model.blocks[0][0].register_forward_hook(lambda *_, runs=runs: runs.append(1))
        model(x).square().sum().backward()
        grads.append([p.grad for p in model.parameters()])
        calls.append(len(runs))
    assert calls == [1, 2], "a checkpointed block runs its forward again during backward"
    for plain, recomputed in zip(*grads):
        assert torch.allclose(plain, recomputed, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="--model mlp"):
        enable_activation_checkpointing(build_model("cnn"))


def test_linear_warmup_and_scaling_rule():
    from course_utils.trainer import linear_warmup, scaled_lr

    opt = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.8)
    sched = linear_warmup(opt, 4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.2, 0.4, 0.6, 0.8, 0.8, 0.8])
    assert scaled_lr(0.1, 4, 2) == pytest.approx(0.8)


def test_groupnorm_cnn_does_not_depend_on_the_batch_split():
    torch.manual_seed(0)
    model = build_model("cnn-gn").train()
    x = torch.randn(8, 3, 32, 32)
    whole = model(x)
    halves = torch.cat([model(x[:4]), model(x[4:])])
    torch.testing.assert_close(whole, halves, rtol=1e-5, atol=1e-6)
    bn = build_model("cnn").train()
    assert not torch.allclose(bn(x), torch.cat([bn(x[:4]), bn(x[4:])]), atol=1e-4), "BatchNorm does"


def test_resumed_run_is_bit_identical_to_uninterrupted(tmp_path):
    """Stop after epoch 1 of 3, resume in a fresh Trainer: the final weights match bit for bit
    (data order from (seed, epoch), augmentation RNG restored from the checkpoint)."""

    def trainer(epochs, ckpt):
        torch.manual_seed(0)
        train, _, _ = data.get_datasets("synthetic", n_train=256, n_val=8, augment=True)
        return Trainer(build_model("cnn"), data.make_loader(train, 64, shuffle=True, seed=3), "cpu",
                       TrainConfig(epochs=epochs, progress=False, ckpt_dir=str(ckpt)))

    straight = trainer(3, tmp_path / "a")
    straight.fit()
    first = trainer(1, tmp_path / "b")
    first.fit()
    torch.manual_seed(12345)  # a new process would not share the old one's RNG
    resumed = trainer(3, tmp_path / "b")
    assert resumed.epoch == 1
    resumed.fit()
    for a, b in zip(straight.raw_model.state_dict().values(), resumed.raw_model.state_dict().values()):
        assert torch.equal(a, b)


def test_flops_per_image_match_the_resnet18_by_hand():
    from course_utils.ladder import train_flops_per_image

    # CIFAR ResNet-18: 0.56 G multiply-adds forward = 1.11 GFLOP; backward costs twice the forward.
    assert train_flops_per_image("resnet18") == pytest.approx(3 * 1.11e9, rel=0.02)
    assert train_flops_per_image("cnn") < train_flops_per_image("resnet18") / 10


def test_the_course_optimiser_takes_cudas_foreach_path_and_steps_dtensors_beside_plain_tensors(one_rank_group):
    """A tensor-parallel model keeps plain parameters (its LayerNorms) beside DTensors. On CUDA torch's
    optimisers take the foreach path, which refuses a list mixing the two; the course's optimiser asks for
    that path on every device, so a CPU run meets the refusal, and steps the two kinds as separate groups."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from course_utils.trainer import build_optimizer

    mesh = init_device_mesh("cpu", (1,))

    def params():
        plain = nn.Parameter(torch.ones(4))
        split = nn.Parameter(distribute_tensor(torch.ones(4), mesh, [Replicate()]))
        plain.sum().backward()  # a LayerNorm outside the plan: plain weights, plain gradients
        split.sum().backward()
        return plain, split

    with pytest.raises(Exception, match="mixed torch.Tensor and DTensor"):
        torch.optim.SGD(params(), lr=0.5, momentum=0.9, foreach=True).step()  # what CUDA's default does
    plain, split = params()
    for name in ("sgd", "adamw"):
        opt = build_optimizer([plain, split], name, lr=0.5, momentum=0.9)
        assert all(group["foreach"] for group in opt.param_groups)
        opt.step()
    assert plain.detach().lt(1).all() and split.to_local().lt(1).all(), "both kinds stepped"


def test_every_trainer_takes_deterministic_kernels_from_its_environment(monkeypatch):
    """The door every trainer passes (resolve_precision: the course Trainer, the loop by hand, Lightning, Fabric,
    DeepSpeed and FSDP) switches torch to deterministic kernels when the run's environment asks for them
    (notebooks 05 and 06 launch runs with deterministic_env()), and not otherwise."""
    from course_utils.precision import deterministic_env, deterministic_state

    before = deterministic_state()
    try:
        monkeypatch.delenv("COURSE_DETERMINISTIC", raising=False)
        _linear_trainer(16, 1)
        assert deterministic_state() == before, "not asked: torch's defaults stay"
        for name, value in deterministic_env().items():
            monkeypatch.setenv(name, value)
        torch.backends.cudnn.benchmark = True
        trainer = _linear_trainer(16, 1)
        assert deterministic_state() == {"use_deterministic_algorithms": True, "cudnn_deterministic": True,
                                         "cudnn_benchmark": False}
        trainer.fit()  # and trains in that mode
        assert resolve_precision("fp32", "cpu") == "fp32"
    finally:
        torch.use_deterministic_algorithms(before["use_deterministic_algorithms"])
        torch.backends.cudnn.deterministic = before["cudnn_deterministic"]
        torch.backends.cudnn.benchmark = before["cudnn_benchmark"]


def test_without_a_progress_bar_a_long_epoch_says_where_it_is_now_and_then(monkeypatch, capsys):
    """A batch log gets no bar: a line at most every LINE_EVERY_S (60 s) says the job is alive and where it is
    (here every logged step, the interval set to 0); with the interval not reached, nothing."""
    from course_utils import trainer as trainer_module

    _linear_trainer(8, 1, log_every=2).fit()
    assert "batch" not in capsys.readouterr().out, "an epoch shorter than the interval prints no line"
    monkeypatch.setattr(trainer_module, "LINE_EVERY_S", 0.0)
    _linear_trainer(8, 1, log_every=2).fit()
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("epoch 0: batch")]
    assert lines[0].startswith("epoch 0: batch 2/8, step 2, loss ") and lines[-1].startswith("epoch 0: batch 8/8"), lines
    assert len(lines) == 4, lines
