"""What the plain scripts train: a model and a data set, nothing distributed. Replace both with yours.

plain_single.py, plain_ddp.py and plain_resumable.py import them, so the diff between two of those
scripts is only what makes training distributed, then resumable (notebooks 03 and 05 show it).
"""

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset


def build_model() -> nn.Module:
    """A small CNN for 1x28x28 images in 10 classes."""
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 7 * 7, 10),
    )


def get_dataset(n: int, data_dir: str | None = None, train: bool = True) -> Dataset:
    """MNIST's training images (its test images: ``train=False``) from ``data_dir`` (torchvision's layout), else
    ``n`` offline stand-ins (held out with ``train=False``: the same classes, other images).

    Compute nodes often have no internet: download MNIST once on a login node,
        python -c "import torchvision; torchvision.datasets.MNIST('data', download=True)"
    then pass --data data. The stand-ins need nothing: each of 10 classes is a fixed random
    pattern, and every image is its class's pattern under heavy noise (the same on every rank).
    """
    if data_dir:
        import torchvision

        return torchvision.datasets.MNIST(data_dir, train=train, transform=torchvision.transforms.ToTensor())
    g = torch.Generator().manual_seed(0)
    patterns = torch.randn(10, 1, 28, 28, generator=g)
    if not train:
        g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, 10, (n,), generator=g)
    images = patterns[labels] + 4.0 * torch.randn(n, 1, 28, 28, generator=g)
    return TensorDataset(images, labels)


def evaluate(model: nn.Module, loader: DataLoader, device: torch.device) -> torch.Tensor:
    """The summed loss, the correct predictions and the images over ``loader``: sums, which ranks can add."""
    model.eval()
    sums = torch.zeros(3, device=device)
    with torch.no_grad():
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            out = model(x).float()
            loss = nn.functional.cross_entropy(out, y, reduction="sum")
            sums += torch.stack([loss, (out.argmax(1) == y).sum().float(), torch.tensor(float(len(y)), device=device)])
    model.train()
    return sums
