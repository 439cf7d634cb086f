"""Real data: the small CNN reaches >= 95% on held-out real MNIST digits.

Uses the MNIST test set in ../shared/data/mnist-t10k (10,000 images; 8,000 to
train, 2,000 to evaluate) when it is beside the checkout, as on the course's
CI. A fresh clone has no ../shared, and then this test is skipped.
"""


import pytest
import torch

from course_utils import data
from course_utils.models import build_model
from course_utils.paths import REPO_ROOT
from course_utils.trainer import TrainConfig, Trainer

MNIST_DIR = REPO_ROOT.parent / "shared" / "data" / "mnist-t10k"


@pytest.mark.skipif(
    not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists(),
    reason=f"real MNIST test set not found at {MNIST_DIR} (only the course's CI has ../shared)",
)
def test_small_cnn_reaches_95_percent_on_real_mnist():
    torch.manual_seed(0)
    train, val, info = data.get_datasets("mnist-idx", root=MNIST_DIR, n_train=8000, n_val=2000)
    assert len(train) == 8000 and len(val) == 2000
    model = build_model("cnn", info.channels, info.num_classes)
    loader = data.make_loader(train, 64, shuffle=True)
    epochs = 2
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=0.1, total_steps=epochs * len(loader))
    trainer = Trainer(
        model, loader, "cpu", TrainConfig(epochs=epochs, progress=False),
        val_loader=data.make_loader(val, 500, shuffle=False), optimizer=optimizer, scheduler=schedule,
    )
    history = trainer.fit()
    print(f"real MNIST: accuracy {history[-1].val_acc:.4f} on 2,000 held-out digits")
    assert history[-1].val_acc >= 0.95
