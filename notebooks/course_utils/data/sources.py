"""Where the course's data sets come from, and one entry point for all of them: :func:`get_datasets`."""

from __future__ import annotations

import gzip
import hashlib
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset, Subset

from ..paths import REPO_ROOT
from .shards import ShardDataset, read_manifest, read_shard
from .synthetic import make_synthetic

DATASETS = ("synthetic", "cifar10", "mnist", "mnist-idx", "shards")


class DatasetMissingError(RuntimeError):
    """A real data set is not on disk; the message says how to fetch it."""


@dataclass(frozen=True)
class DatasetInfo:
    name: str
    num_classes: int
    channels: int
    size: int
    mean: tuple[float, ...]
    std: tuple[float, ...]


INFO = {
    "synthetic": DatasetInfo("synthetic", 10, 3, 32, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)),
    "cifar10": DatasetInfo(
        "cifar10", 10, 3, 32, (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
    ),
    "mnist": DatasetInfo("mnist", 10, 1, 28, (0.1307,), (0.3081,)),
    "mnist-idx": DatasetInfo("mnist-idx", 10, 1, 28, (0.1307,), (0.3081,)),
}


def default_data_root() -> Path:
    """``$COURSE_DATA`` if set (on a cluster: a folder in ``$STORE`` or
    ``$WORK``), else the repository's ``data/`` folder."""
    return Path(os.environ.get("COURSE_DATA", REPO_ROOT / "data")).expanduser()


def workshop_dataset(full: bool, root: str | Path | None = None) -> tuple[str, str]:
    """The data set a notebook trains on, and one line that says which and why.

    The full profile trains on the real CIFAR-10 when it has been downloaded
    (on a login node: ``python -m course_utils.data download cifar10``);
    otherwise, and always in the CI profile, on the offline synthetic set.
    """
    root = Path(root).expanduser() if root else default_data_root()
    if not full:
        return "synthetic", "data: the offline synthetic set (CI profile)"
    if (root / "cifar-10-batches-py").is_dir():
        return "cifar10", f"data: CIFAR-10 from {root}"
    return "synthetic", (f"data: the offline synthetic set; CIFAR-10 is not in {root} (on a login node: "
                         f"python -m course_utils.data download cifar10 --root {root})")


class TensorImageDataset(Dataset):
    """In-memory ``uint8`` images with the usual per-sample CPU work.

    ``__getitem__`` converts to float, optionally random-crops (pad 4) and
    flips, and normalises: the work DataLoader workers exist to hide.
    """

    def __init__(
        self,
        images: torch.Tensor,
        labels: torch.Tensor,
        mean: tuple[float, ...],
        std: tuple[float, ...],
        augment: bool = False,
        flip: bool = True,
    ) -> None:
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError("images must be uint8 [N, C, H, W]")
        self.images, self.labels = images, labels.long()
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)
        self.augment, self.flip = augment, flip

    def __len__(self) -> int:
        return self.images.shape[0]

    def __getitem__(self, idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        img = self.images[idx].float().div_(255)
        if self.augment:
            h, w = img.shape[-2:]
            padded = torch.nn.functional.pad(img, (4, 4, 4, 4), mode="reflect")
            top, left = torch.randint(0, 9, (2,)).tolist()
            img = padded[:, top : top + h, left : left + w]
            if self.flip and torch.rand(()) < 0.5:
                img = img.flip(-1)
        img = (img - self.mean) / self.std
        return img, self.labels[idx]


# --------------------------------------------------------------------------- #
# MNIST idx files (no torchvision needed)
# --------------------------------------------------------------------------- #
def read_idx(path: str | Path) -> np.ndarray:
    """Read an idx file (optionally gzipped), the format MNIST ships in."""
    path = Path(path)
    opener: Callable = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rb") as fh:
        raw = fh.read()
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise ValueError(f"{path} is not an unsigned-byte idx file")
    shape = struct.unpack(">" + "I" * ndim, raw[4 : 4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path} is truncated: {data.size} bytes for shape {shape}")
    return data.reshape(shape)


def verify_md5sums(folder: str | Path) -> None:
    """Check every file listed in ``folder/MD5SUMS``; raise on a mismatch."""
    folder = Path(folder)
    sums = folder / "MD5SUMS"
    if not sums.exists():
        return
    for line in sums.read_text().splitlines():
        if not line.strip():
            continue
        expected, name = line.split()
        digest = hashlib.md5((folder / name).read_bytes()).hexdigest()
        if digest != expected:
            raise ValueError(f"{folder / name}: MD5 {digest} != {expected}; re-copy the file")


def load_mnist_idx(folder: str | Path, prefix: str = "t10k") -> tuple[torch.Tensor, torch.Tensor]:
    """MNIST images ``uint8 [N, 1, 28, 28]`` and labels from idx files in ``folder``."""
    folder = Path(folder)
    img_path = folder / f"{prefix}-images-idx3-ubyte.gz"
    lab_path = folder / f"{prefix}-labels-idx1-ubyte.gz"
    for p in (img_path, lab_path):
        if not p.exists():
            raise DatasetMissingError(f"{p} not found: copy the MNIST idx files into {folder}")
    verify_md5sums(folder)
    images = torch.from_numpy(read_idx(img_path).copy()).unsqueeze(1)
    labels = torch.from_numpy(read_idx(lab_path).astype(np.int64))
    return images, labels


# --------------------------------------------------------------------------- #
# torchvision data sets (downloaded on a login node)
# --------------------------------------------------------------------------- #
def _torchvision_cls(name: str):
    from torchvision import datasets  # imported late: only the real data sets need it

    return {"cifar10": datasets.CIFAR10, "mnist": datasets.MNIST}[name]


def download(name: str, root: str | Path) -> Path:
    """Fetch ``cifar10`` or ``mnist`` (train and test) into ``root``. Run this
    where there is internet: a login node, not a compute node."""
    if name not in ("cifar10", "mnist"):
        raise ValueError(f"only cifar10 and mnist are downloaded; {name!r} needs no download")
    root = Path(root).expanduser()
    root.mkdir(parents=True, exist_ok=True)
    cls = _torchvision_cls(name)
    for train in (True, False):
        cls(str(root), train=train, download=True)
    return root


def _missing_message(name: str, root: Path) -> str:
    return (
        f"The {name} data set is not in {root}, and this node cannot download it "
        f"(compute nodes are usually offline). On a login node, run once:\n\n"
        f"    python -m course_utils.data download {name} --root {root}\n\n"
        f"then rerun here (set $COURSE_DATA or --data-root to that folder if it moved). "
        f"Or use --dataset synthetic, which needs no download."
    )


def _torchvision_split(name: str, root: Path, train: bool, augment: bool) -> Dataset:
    from torchvision import transforms as T

    info = INFO[name]
    steps: list = []
    if augment and name == "cifar10":
        steps += [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip()]
    steps += [T.ToTensor(), T.Normalize(info.mean, info.std)]
    try:
        return _torchvision_cls(name)(
            str(root), train=train, download=False, transform=T.Compose(steps)
        )
    except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
        raise DatasetMissingError(_missing_message(name, root)) from exc


def get_datasets(
    name: str = "synthetic",
    root: str | Path | None = None,
    n_train: int | None = None,
    n_val: int | None = None,
    augment: bool = True,
    seed: int = 0,
) -> tuple[Dataset, Dataset, DatasetInfo]:
    """Train and validation sets plus their :class:`DatasetInfo`.

    ``n_train``/``n_val`` cut the sets down (the CI profile uses this);
    for ``synthetic`` they are how many images to draw (default 20k/4k).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if name == "shards":
        return _shard_datasets(root, n_train, n_val, seed)
    info = INFO[name]
    if name == "synthetic":
        n_tr, n_va = n_train or 20_000, n_val or 4_000
        # disjoint seeds: validation images are never training images
        xtr, ytr = make_synthetic(n_tr, seed=seed * 2 + 1)
        xva, yva = make_synthetic(n_va, seed=seed * 2 + 2)
        train = TensorImageDataset(xtr, ytr, info.mean, info.std, augment=augment)
        val = TensorImageDataset(xva, yva, info.mean, info.std)
        return train, val, info
    root = Path(root).expanduser() if root else default_data_root()
    if name == "mnist-idx":
        images, labels = load_mnist_idx(root)
        g = torch.Generator().manual_seed(seed)
        perm = torch.randperm(len(labels), generator=g)
        n_va = n_val or len(labels) // 5
        n_tr = n_train or len(labels) - n_va
        tr, va = perm[:n_tr], perm[len(labels) - n_va :]
        train = TensorImageDataset(images[tr], labels[tr], info.mean, info.std, augment=False)
        val = TensorImageDataset(images[va], labels[va], info.mean, info.std)
        return train, val, info
    train_ds = _torchvision_split(name, root, True, augment)
    val_ds = _torchvision_split(name, root, False, False)
    if n_train:
        train_ds = Subset(train_ds, range(min(n_train, len(train_ds))))
    if n_val:
        val_ds = Subset(val_ds, range(min(n_val, len(val_ds))))
    return train_ds, val_ds, info


def _shard_datasets(root: str | Path | None, n_train: int | None, n_val: int | None,
                    seed: int) -> tuple[Dataset, Dataset, DatasetInfo]:
    """``--dataset shards [--data-root DIR]``: the tar shards ``python -m course_utils.data shard`` wrote
    in DIR (default: ``$COURSE_DATA/shards``): DIR/train streamed (each rank and worker reads its own
    shards), DIR/val read whole into memory. No augmentation: the shards hold the images to be learnt."""
    if n_train or n_val:
        raise ValueError("--n-train/--n-val do not cut shards: write fewer (python -m course_utils.data shard -n N)")
    root = Path(root).expanduser() if root else default_data_root() / "shards"  # where data/stage.sh puts them
    try:
        train_manifest, val_manifest = read_manifest(root / "train"), read_manifest(root / "val")
    except FileNotFoundError as exc:
        raise DatasetMissingError(str(exc)) from exc
    source = INFO[train_manifest["source"]]
    info = DatasetInfo("shards", source.num_classes, source.channels, source.size, source.mean, source.std)
    train = ShardDataset(root / "train", info.mean, info.std, seed=seed)
    samples = [(image, label) for shard in val_manifest["shards"]
               for _, image, label in read_shard(root / "val" / shard["name"])]
    val = TensorImageDataset(torch.stack([x for x, _ in samples]), torch.tensor([y for _, y in samples]),
                             info.mean, info.std)
    return train, val, info


def raw_images(name: str, root: str | Path | None = None, n: int | None = None,
               seed: int = 0, split: str = "train") -> tuple[torch.Tensor, torch.Tensor]:
    """A data set's images as stored, ``uint8 [N, C, H, W]``, and labels: what shards hold (the first
    ``n``). ``split``: ``train`` or ``val`` (``get_datasets``' validation images: the test split;
    ``synthetic`` draws ``n``, default 20,000 / 4,000, with the seeds ``get_datasets`` uses)."""
    if split not in ("train", "val"):
        raise ValueError(f"split is train or val, not {split!r}")
    if name == "synthetic":
        return make_synthetic(n or (20_000 if split == "train" else 4_000), seed=seed * 2 + (1 if split == "train" else 2))
    root = Path(root).expanduser() if root else default_data_root()
    if name == "mnist-idx":
        if split == "val":
            raise ValueError("mnist-idx is one set of images (MNIST's test set): it has no validation split to shard")
        images, labels = load_mnist_idx(root)
    elif name in ("cifar10", "mnist"):
        from torchvision import datasets

        cls = datasets.CIFAR10 if name == "cifar10" else datasets.MNIST
        try:
            ds = cls(str(root), train=split == "train", download=False)
        except RuntimeError as exc:  # torchvision: "Dataset not found or corrupted"
            raise DatasetMissingError(_missing_message(name, root)) from exc
        data = torch.as_tensor(np.asarray(ds.data))
        images = data.permute(0, 3, 1, 2) if data.dim() == 4 else data.unsqueeze(1)
        labels = torch.as_tensor(ds.targets)
    else:
        raise ValueError(f"no raw images for {name!r}: synthetic, mnist-idx, cifar10 or mnist")
    return images[:n].contiguous(), labels[:n]


def held_out_set(name: str = "synthetic", root: str | Path | None = None, n: int = 1000,
                 n_train: int | None = None, n_val: int | None = None, seed: int = 0) -> Dataset:
    """``n`` images that neither the training nor the validation set of :func:`get_datasets` holds.

    A search picks its best configuration on the validation set, so its score there is
    optimistic; judge the winner on images no trial has seen (notebook 08).
    """
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    info = INFO[name]
    if name == "synthetic":
        x, y = make_synthetic(n, seed=-(seed + 1))  # get_datasets draws from seeds 2s+1 and 2s+2 >= 1
        return TensorImageDataset(x, y, info.mean, info.std)
    root = Path(root).expanduser() if root else default_data_root()
    empty = ValueError(f"no {name} images are left for a held-out set: lower n_train or n_val")
    if name == "mnist-idx":
        images, labels = load_mnist_idx(root)
        perm = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
        n_va = n_val or len(labels) // 5
        n_tr = n_train or len(labels) - n_va
        spare = perm[n_tr : len(labels) - n_va][:n]  # between the training and the validation images
        if len(spare) == 0:
            raise empty
        return TensorImageDataset(images[spare], labels[spare], info.mean, info.std)
    test = _torchvision_split(name, root, False, False)
    if not n_val:
        raise ValueError(f"the whole {name} test split is the validation set: set n_val to keep some back")
    if n_val >= len(test):
        raise empty
    return Subset(test, range(n_val, min(n_val + n, len(test))))
