"""The same images in four on-disk formats, and what reading them for training costs (notebook 10).

* ``png`` and ``jpeg``: one file per image, in ``torchvision.datasets.ImageFolder``'s layout
  (``<label>/<index>.png``): simple, and a file (and a metadata operation) per sample.
* ``npy``: one array file (``images.npy``, ``labels.npy``), read through a memory map: no decoding,
  a sample is a slice; the idea behind HDF5 and LMDB, with nothing to install.
* ``shards``: tar files of many PNG samples each (:mod:`.shards`, WebDataset's layout), read front
  to back: few files, streamed.

Each reader is a ``Dataset`` a ``DataLoader`` drives as in training; ``read_epoch`` times one pass
with the pages of the files dropped from this node's cache first, as notebook 00 does for its files.
``step_breakdown`` splits a training step of a JPEG-reading job into read, decode, host-to-device
copy and compute; ``emulate_training`` is the DLIO benchmark's method: compute replaced by a sleep of
its measured time, to see whether the input pipeline keeps up.
"""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..storage import drop_cached_pages
from .loaders import make_loader

FORMATS = ("png", "jpeg", "npy", "shards")
SUFFIX = {"png": ".png", "jpeg": ".jpg"}


@dataclass
class Written:
    format: str
    folder: Path
    files: int
    bytes: int
    write_s: float


def _encoded(image: torch.Tensor, fmt: str) -> bytes:
    from torchvision.io import encode_jpeg, encode_png

    encoded = encode_jpeg(image, quality=90) if fmt == "jpeg" else encode_png(image)
    return encoded.numpy().tobytes()


def write_format(fmt: str, images: torch.Tensor, labels: torch.Tensor, folder: str | Path,
                 per_shard: int = 256, source: str = "synthetic") -> Written:
    """``images`` (``uint8 [N, C, H, W]``) and ``labels`` written in format ``fmt`` into ``folder``
    (emptied first), every file flushed to the storage (``fsync``) as a data set copied there would be."""
    from .shards import write_shards

    if fmt not in FORMATS:
        raise ValueError(f"format {fmt!r}: one of {', '.join(FORMATS)}")
    folder = Path(folder)
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    start = time.perf_counter()
    if fmt in SUFFIX:
        for index, (image, label) in enumerate(zip(images, labels.tolist(), strict=True)):
            (folder / str(label)).mkdir(exist_ok=True)
            (folder / str(label) / f"{index:06d}{SUFFIX[fmt]}").write_bytes(_encoded(image, fmt))
    elif fmt == "npy":
        np.save(folder / "images.npy", images.numpy())
        np.save(folder / "labels.npy", labels.numpy().astype(np.int64))
    else:
        write_shards(images, labels, folder, per_shard, source=source)
    files = files_in(folder)
    for path in files:
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())
    return Written(fmt, folder, len(files), sum(p.stat().st_size for p in files), time.perf_counter() - start)


def files_in(folder: str | Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


class _Timed:
    """Seconds spent reading bytes and decoding them, in this process (a DataLoader without workers)."""

    def reset_timers(self) -> None:
        self.read_s = self.decode_s = 0.0


class ImageFiles(Dataset, _Timed):
    """One PNG or JPEG file per image, ``<label>/<name>``: read the bytes, decode (torchvision.io, the
    libraries PIL also uses), normalise."""

    def __init__(self, folder: str | Path, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.items = [(p, int(p.parent.name)) for p in files_in(folder)]
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)
        self.reset_timers()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        from torchvision.io import decode_image

        path, label = self.items[index]
        start = time.perf_counter()
        data = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        read = time.perf_counter()
        image = decode_image(data)
        out = (image.float().div_(255) - self.mean) / self.std
        self.read_s += read - start
        self.decode_s += time.perf_counter() - read
        return out, label


class ArrayImages(Dataset, _Timed):
    """The images as one ``.npy`` array, memory-mapped: a sample is a slice of the file, read when touched."""

    def __init__(self, folder: str | Path, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.folder = Path(folder)
        self.labels = np.load(self.folder / "labels.npy")
        self.images: np.ndarray | None = None  # opened in each worker, not pickled to it
        self.mean, self.std = torch.tensor(mean).view(-1, 1, 1), torch.tensor(std).view(-1, 1, 1)
        self.reset_timers()

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if self.images is None:
            self.images = np.load(self.folder / "images.npy", mmap_mode="r")
        start = time.perf_counter()
        image = torch.from_numpy(np.array(self.images[index]))  # the copy reads the pages
        read = time.perf_counter()
        out = (image.float().div_(255) - self.mean) / self.std
        self.read_s += read - start
        self.decode_s += time.perf_counter() - read
        return out, int(self.labels[index])

    def __getstate__(self) -> dict:
        return {**self.__dict__, "images": None}


def reader(fmt: str, folder: str | Path, mean: tuple[float, ...], std: tuple[float, ...]) -> Dataset:
    """The dataset that reads ``folder`` (written by :func:`write_format` in ``fmt``)."""
    from .shards import ShardDataset

    if fmt in SUFFIX:
        return ImageFiles(folder, mean, std)
    if fmt == "npy":
        return ArrayImages(folder, mean, std)
    return ShardDataset(folder, mean, std, rank=0, world=1)


def read_epoch(loader: DataLoader, folder: str | Path | None = None, epochs: int = 1) -> dict[str, float]:
    """``epochs`` passes over ``loader``, each after dropping the cached pages of the files in ``folder``:
    seconds per epoch (the last), images per second, and the seconds until the first batch of the last
    epoch (worker start-up and the first reads)."""
    times, first = [], 0.0
    images = 0
    for _ in range(epochs):
        if folder is not None:
            drop_cached_pages(files_in(folder))
        start = time.perf_counter()
        images = 0
        for i, (x, _) in enumerate(loader):
            if i == 0:
                first = time.perf_counter() - start
            images += len(x)
        times.append(time.perf_counter() - start)
    return {"epoch_s": times[-1], "images_per_s": images / times[-1], "first_batch_s": first, "images": images}


def step_breakdown(dataset: ImageFiles | ArrayImages, model: torch.nn.Module, device: torch.device,
                   batch_size: int, steps: int) -> dict[str, float]:
    """Milliseconds per training step spent reading, decoding (and normalising), copying to ``device``
    and computing (forward, backward, SGD step), measured in one process (no workers) so each part is
    alone; the GPU is synchronised before each clock is read."""
    from ..timing import sync

    loader = make_loader(dataset, batch_size, workers=0)  # shuffled, as in training
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    parts = {"read": 0.0, "decode": 0.0, "copy": 0.0, "compute": 0.0}
    done = 0
    dataset.reset_timers()
    for i, (x, y) in enumerate(loader):
        if i == steps + 1:
            break
        start = time.perf_counter()
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        sync(device)
        copied = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        if i == 0:  # the first step warms up (allocations, kernels): left out, with its reads
            dataset.reset_timers()
            continue
        parts["copy"] += copied - start
        parts["compute"] += time.perf_counter() - copied
        done += 1
    parts["read"], parts["decode"] = dataset.read_s, dataset.decode_s
    return {k: 1000 * v / max(done, 1) for k, v in parts.items()}


def emulate_training(loader: DataLoader, compute_s: float, steps: int) -> dict[str, float]:
    """The DLIO benchmark's method: each step waits for its batch, then sleeps ``compute_s`` where a GPU
    would compute (the CPU is free meanwhile, as it is while a GPU works). Returns the mean step time, the
    mean wait for data, and the share of the step the 'GPU' is busy. The loader must hold ``steps`` + 1 full
    batches (the first is left out; a short last batch would flatter the wait)."""
    full = len(loader.dataset) // loader.batch_size
    if steps + 1 > full:
        raise ValueError(f"{steps} timed steps need {steps + 1} full batches of {loader.batch_size}; the loader holds "
                         f"{full}: ask for at most {full - 1} steps, or give it more images")
    waits = []
    it = iter(loader)
    next(it)  # worker start-up is paid once per epoch, not per step: left out
    start = time.perf_counter()
    for _ in range(steps):
        asked = time.perf_counter()
        try:
            next(it)
        except StopIteration:
            break
        waits.append(time.perf_counter() - asked)
        time.sleep(compute_s)
    elapsed = time.perf_counter() - start
    step = elapsed / max(len(waits), 1)
    return {"step_ms": 1000 * step, "wait_ms": 1000 * sum(waits) / max(len(waits), 1),
            "busy": compute_s / step, "steps": len(waits)}


def decoders_to_time(device_type: str) -> list[str]:
    """Where to decode JPEGs for the comparison: the CPU always; the GPU too where there is one
    (``torchvision.io.decode_jpeg(..., device="cuda")``, nvJPEG)."""
    return ["cpu", "cuda"] if device_type == "cuda" else ["cpu"]


def decode_rate(jpegs: list[torch.Tensor], where: str, repeats: int = 3, *, decode=None, synchronize=None,
                clock=time.perf_counter) -> float:
    """Images per second decoding ``jpegs`` (encoded bytes as uint8 tensors) on ``where``, best of
    ``repeats``; on the GPU the batch goes in one call and the clock waits for the GPU.

    ``decode``, ``synchronize``, ``clock``: torchvision's ``decode_jpeg``, ``torch.cuda.synchronize`` and the
    clock; a test gives its own to check the GPU branch where there is no GPU."""
    if decode is None:
        from torchvision.io import decode_jpeg as decode
    synchronize = synchronize or torch.cuda.synchronize
    timings = []
    for _ in range(repeats + 1):  # the first is a warm-up (the GPU's loads nvJPEG): dropped
        start = clock()
        if where == "cuda":
            decode(jpegs, device="cuda")  # nvJPEG decodes a list as one batch
            synchronize()  # the call returns before the GPU has finished
        else:
            for data in jpegs:
                decode(data)
        timings.append(clock() - start)
    return len(jpegs) / min(timings[1:])
