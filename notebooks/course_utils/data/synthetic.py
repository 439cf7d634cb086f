"""The offline default data set: ten classes of shapes and textures, drawn procedurally.

It needs no download, is the same on every machine for a given seed, and a
CNN can learn it (it is not noise), so a notebook on an offline compute node
still teaches something.
"""

from __future__ import annotations

import torch

CLASS_NAMES = (
    "disc", "ring", "square", "frame", "h-stripes",
    "v-stripes", "diagonal", "checker", "cross", "triangle",
)


def make_synthetic(
    n: int, seed: int = 0, channels: int = 3, size: int = 32, noise: float = 0.12
) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw ``n`` labelled images: ``uint8 [n, channels, size, size]`` and labels.

    Deterministic for a given ``(n, seed, channels, size)``. Class ``k`` is the
    shape ``CLASS_NAMES[k]``; position, scale, stripe frequency, colours and
    pixel noise are random per image, so memorising pixels does not work.
    """
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 10
    labels = labels[torch.randperm(n, generator=g)]
    images = torch.empty(n, channels, size, size, dtype=torch.uint8)
    lin = torch.linspace(-1.0, 1.0, size)
    yy, xx = torch.meshgrid(lin, lin, indexing="ij")
    for start in range(0, n, 2048):
        lab = labels[start : start + 2048]
        m = lab.numel()

        def rand(*shape: int) -> torch.Tensor:
            return torch.rand(*shape, generator=g)

        cx, cy = (rand(m) - 0.5) * 0.6, (rand(m) - 0.5) * 0.6
        s = 0.55 + 0.4 * rand(m)
        freq = 6.0 + 8.0 * rand(m)
        phase = rand(m) * 6.283
        x = xx[None] - cx[:, None, None]
        y = yy[None] - cy[:, None, None]
        s_, f_, p_ = s[:, None, None], freq[:, None, None], phase[:, None, None]
        r = torch.sqrt(x * x + y * y)
        box = torch.maximum(x.abs(), y.abs())
        masks = torch.stack(
            [
                r < 0.5 * s_,
                (r - 0.45 * s_).abs() < 0.1,
                box < 0.45 * s_,
                (box - 0.4 * s_).abs() < 0.09,
                torch.sin(f_ * yy[None] + p_) > 0,
                torch.sin(f_ * xx[None] + p_) > 0,
                torch.sin(f_ * 0.7 * (xx[None] + yy[None]) + p_) > 0,
                (torch.sin(0.6 * f_ * xx[None] + p_) * torch.sin(0.6 * f_ * yy[None])) > 0,
                ((x.abs() < 0.12) | (y.abs() < 0.12)) & (box < 0.5 * s_),
                (y > -0.4 * s_) & (y < 0.45 * s_) & (x.abs() < (0.45 * s_ - y) * 0.55),
            ],
            dim=1,
        )  # [m, 10, H, W]
        mask = masks[torch.arange(m), lab].float()[:, None]  # [m, 1, H, W]
        fg = rand(m, channels, 1, 1)
        bg = rand(m, channels, 1, 1)
        # keep the shape visible: push the two colours at least 0.35 apart
        gap = (fg - bg).mean(dim=1, keepdim=True)
        bg = torch.where(gap.abs() < 0.35, (fg - 0.5 * torch.sign(gap + 1e-6)).clamp(0, 1), bg)
        img = mask * fg + (1 - mask) * bg
        img = img + noise * torch.randn(img.shape, generator=g)
        images[start : start + m] = (img.clamp(0, 1) * 255).round().to(torch.uint8)
    return images, labels
