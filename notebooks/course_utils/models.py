"""The course's models: a small CNN (seconds per epoch on a laptop CPU),
a CIFAR-style ResNet-18 (the usual GPU benchmark: 11 M parameters,
3x3 stem and no max-pool, so 32x32 inputs keep their resolution), and a wide
MLP whose 4 M parameters sit almost all in large weight matrices (the model of
notebook 07, where the memory of weights, gradients and optimizer state is the lesson)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

MODELS = ("cnn", "cnn-gn", "resnet18", "mlp")
CHECKPOINTABLE = ("mlp",)
NORMS = ("batch", "group", "none")  # models written for activation checkpointing


class SmallCNN(nn.Module):
    """Convolutions (``depth`` of them, 3 by default), then a linear head; works for 1x28x28 and 3x32x32.

    ``width``, ``depth`` and ``norm`` (batch, group or none) are what notebook 08's architecture
    search varies; the defaults are the course's ``cnn``. No dropout: the course compares runs
    parameter by parameter, and dropout would make two equivalent runs differ for reasons that are not the lesson.
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 32,
                 norm: str = "batch", depth: int = 3) -> None:
        super().__init__()
        if norm not in NORMS:
            raise ValueError(f"norm must be one of: {', '.join(NORMS)} (got {norm!r})")
        if depth < 2 or width % 8:
            raise ValueError(f"SmallCNN needs depth >= 2 and a width divisible by 8 (GroupNorm's 8 groups); "
                             f"got depth {depth}, width {width}")

        def norm_layer(c: int) -> nn.Module:
            # BatchNorm statistics depend on the batch a rank sees; GroupNorm's are
            # per image, so N ranks x B images compute exactly what 1 x N*B would.
            return {"batch": nn.BatchNorm2d, "group": lambda c: nn.GroupNorm(8, c), "none": lambda c: nn.Identity()
                    }[norm](c)

        layers: list[nn.Module] = []
        for i in range(depth):  # halve the resolution after the first two; the rest keep it
            c_in, c_out = (in_channels, width) if i == 0 else (width if i == 1 else 2 * width, 2 * width)
            layers += [nn.Conv2d(c_in, c_out, 3, padding=1), norm_layer(c_out), nn.ReLU(inplace=True)]
            if i < 2:
                layers.append(nn.MaxPool2d(2))
        self.features = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1))
        self.head = nn.Linear(2 * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.flatten(self.features(x), 1))


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (He et al. 2016, CIFAR variant)."""

    def __init__(self, in_channels: int = 3, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(in_channels, 64, 3, 1, 1, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True)
        )
        layers, in_planes = [], 64
        for planes, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
            layers += [BasicBlock(in_planes, planes, stride), BasicBlock(planes, planes, 1)]
            in_planes = planes
        self.layers = nn.Sequential(*layers)
        self.head = nn.Linear(512, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.layers(self.stem(x))
        out = F.adaptive_avg_pool2d(out, 1)
        return self.head(torch.flatten(out, 1))


class MLP(nn.Module):
    """Images pooled to 16x16, then ``depth`` residual linear layers of ``width`` (GELU).

    Width 1024, depth 4: 3,946,506 parameters on 3-channel images, 99.6 % of them in the
    four weight matrices. ``checkpoint_activations``: each hidden block keeps only its input
    and recomputes the rest in the backward pass (less activation memory, one more forward).
    """

    def __init__(self, in_channels: int = 3, num_classes: int = 10, width: int = 1024, depth: int = 4,
                 pooled: int = 16) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.AdaptiveAvgPool2d(pooled), nn.Flatten(),
                                  nn.Linear(in_channels * pooled * pooled, width), nn.GELU())
        self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(depth - 1))
        self.head = nn.Linear(width, num_classes)
        self.checkpoint_activations = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            if self.checkpoint_activations and torch.is_grad_enabled():
                x = x + checkpoint(block, x, use_reentrant=False)
            else:
                x = x + block(x)
        return self.head(x)


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute activations in the backward pass instead of keeping them (the ``mlp`` model)."""
    if not hasattr(model, "checkpoint_activations"):
        raise ValueError(f"activation checkpointing is written for --model {' or '.join(CHECKPOINTABLE)}, "
                         f"not {type(model).__name__}")
    model.checkpoint_activations = True


def build_model(name: str, in_channels: int = 3, num_classes: int = 10, **shape: int | str) -> nn.Module:
    """``cnn``, ``cnn-gn`` (GroupNorm: batch-split invariant), ``resnet18`` or ``mlp``.

    ``shape``: ``width``, ``depth`` or ``norm`` of the CNNs (what notebook 08's architecture search varies).
    """
    if name in ("cnn", "cnn-gn"):
        shape = {"norm": "group" if name == "cnn-gn" else "batch", **shape}
        unknown = set(shape) - {"width", "depth", "norm"}
        if unknown:
            raise ValueError(f"the CNN's shape is set by width, depth and norm, not {', '.join(sorted(unknown))}")
        return SmallCNN(in_channels, num_classes, **shape)
    if shape:
        raise ValueError(f"--model {name} has a fixed shape; width, depth and norm vary the cnn (--model cnn)")
    if name == "resnet18":
        return ResNet18(in_channels, num_classes)
    if name == "mlp":
        return MLP(in_channels, num_classes)
    raise ValueError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
