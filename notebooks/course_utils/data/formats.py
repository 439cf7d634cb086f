"""The same images in four on-disk formats, and what reading them for training costs (notebook 10).

* ``png`` and ``jpeg``: one file per image, in ``torchvision.datasets.ImageFolder``'s layout
  (``<label>/<index>.png``): simple, and a file (and a metadata operation) per sample.
* ``npy``: one array file (``images.npy``, ``labels.npy``), read through a memory map: no decoding,
  a sample is a slice; the idea behind HDF5 and LMDB, with nothing to install.
* ``shards``: tar files of many PNG samples each (:mod:`.shards`, WebDataset's layout), read front
  to back: few files, streamed.

Each reader is a ``Dataset`` a ``DataLoader`` drives as in training; ``read_epoch`` times one pass
with the pages of the files dropped from this node's cache first, as notebook 00 does for its files;
``read_at_once`` opens and reads a folder's files with several processes at once, as the ranks of a
job do. ``step_breakdown`` splits a training step of a JPEG-reading job into read, decode,
host-to-device copy and compute; ``emulate_training`` is the DLIO benchmark's method: compute replaced
by a sleep of its measured time, to see whether the input pipeline keeps up in steady state.
"""

from __future__ import annotations

import math
import multiprocessing
import queue
import shutil
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..storage import drop_cached_pages, sync_files
from .loaders import make_loader

FORMATS = ("png", "jpeg", "npy", "shards")
SUFFIX = {"png": ".png", "jpeg": ".jpg"}
AU_EXPECTED = 0.90
"""DLIO's default expectation (its ``au`` setting): a run keeps up when the accelerator computes at least
90% of the time (``train_au_meet_expectation`` in its summary)."""


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
    sync_files(files)
    return Written(fmt, folder, len(files), sum(p.stat().st_size for p in files), time.perf_counter() - start)


def files_in(folder: str | Path) -> list[Path]:
    return sorted(p for p in Path(folder).rglob("*") if p.is_file())


class _Timed:
    """Seconds spent reading bytes and decoding them, in this process (a DataLoader without workers)."""

    def reset_timers(self) -> None:
        self.read_s = self.decode_s = 0.0


class ImageFiles(Dataset, _Timed):
    """One PNG or JPEG file per image, ``<label>/<name>``: read the bytes, decode with ``torchvision.io``
    (the libpng and libjpeg that torchvision's wheel bundles, which decode the shards' PNGs too), normalise."""

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


class Repeated(Dataset):
    """``dataset``'s samples over and over, ``length`` of them: the DLIO method times many steps in steady
    state, more than a small data set has batches (the cost of a sample does not depend on how often it is
    read: the files are on node-local storage or in the page cache either way)."""

    def __init__(self, dataset: Dataset, length: int) -> None:
        self.dataset, self.length = dataset, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int):
        return self.dataset[index % len(self.dataset)]


def emulate_training(loader: DataLoader, compute_s: float, steps: int, warmup: int | None = None) -> dict[str, float]:
    """The DLIO benchmark's method: each step waits for its batch, then sleeps ``compute_s`` where a GPU
    would compute (the CPU is free meanwhile, as it is while a GPU works).

    Timed in steady state: the first batch (worker start-up, paid once per epoch) and then ``warmup`` more
    steps are left out; by default workers x prefetch_factor steps, the batches the workers prepared ahead
    while the first was awaited, which a short run would consume without waiting. Returns the mean step
    time, its median (a burst of other work on the machine moves the mean, not the median), the mean wait for
    data, and the accelerator utilisation (DLIO's AU): the share of the time the 'accelerator' computes. The loader must hold 1 + ``warmup`` + ``steps`` full batches (:class:`Repeated`
    makes a small data set long enough)."""
    if warmup is None:
        warmup = loader.num_workers * (loader.prefetch_factor or 0)
    needed = 1 + warmup + steps
    full = len(loader.dataset) // loader.batch_size
    if needed > full:
        raise ValueError(f"{steps} timed steps after {1 + warmup} untimed ones need {needed} full batches of "
                         f"{loader.batch_size}; the loader holds {full}: give it more samples "
                         f"(formats.Repeated(dataset, {needed * loader.batch_size})) or ask for fewer steps")
    waits, ends = [], []
    it = iter(loader)
    for _ in range(1 + warmup):  # start-up and the batches prepared ahead: not the steady state
        next(it)
        time.sleep(compute_s)
    start = time.perf_counter()
    for _ in range(steps):
        asked = time.perf_counter()
        next(it)
        waits.append(time.perf_counter() - asked)
        time.sleep(compute_s)
        ends.append(time.perf_counter())
    step = (ends[-1] - start) / steps
    each = sorted(b - a for a, b in zip([start, *ends[:-1]], ends))
    del it  # the workers stop here, not when the caller's next loader starts its own
    return {"step_ms": 1000 * step, "median_step_ms": 1000 * each[len(each) // 2], "wait_ms": 1000 * sum(waits) / steps,
            "au": compute_s / step, "steps": steps, "warmup": warmup}


def _read_share(files: Sequence[Path], repeats: int, barrier, spans) -> None:
    """One reader of :func:`read_at_once`: at each repeat, wait for the others, then open and read each file."""
    for _ in range(repeats):
        barrier.wait()
        start = time.perf_counter()  # CLOCK_MONOTONIC: one clock for every process of the machine
        for path in files:
            with open(path, "rb", buffering=0) as fh:
                while fh.read(1 << 20):
                    pass
        spans.put((start, time.perf_counter()))


def read_at_once(files: Sequence[Path], readers: int, repeats: int = 3) -> dict[str, float]:
    """Open and read ``files`` (the bytes, nothing decoded) with ``readers`` processes at once, reader r
    taking files r, r + readers, ...: the ranks of a job each reading their share, as DLIO runs many ranks.
    Before each repeat the files' cached pages are dropped (:func:`~course_utils.storage.drop_cached_pages`,
    which leaves the metadata caches warm); the readers start together at a barrier, and the time runs from
    the first start to the last end, best of ``repeats``. More readers than files leaves some idle, as
    ranks without a shard would be."""
    if readers < 1 or not files:
        raise ValueError("read_at_once needs at least one reader and one file")
    context = multiprocessing.get_context("fork")  # the readers need nothing from this process but the paths
    barrier, spans = context.Barrier(readers + 1), context.Queue()  # this process opens each repeat's barrier
    procs = [context.Process(target=_read_share, args=(files[r::readers], repeats, barrier, spans), daemon=True)
             for r in range(readers)]
    for proc in procs:
        proc.start()
    best = math.inf
    try:
        for _ in range(repeats):
            drop_cached_pages(files)  # every reader has finished the last repeat: no page is being read
            barrier.wait(timeout=300)
            times = [spans.get(timeout=300) for _ in procs]
            best = min(best, max(end for _, end in times) - min(start for start, _ in times))
    except (queue.Empty, threading.BrokenBarrierError):
        codes = [proc.exitcode for proc in procs]
        raise RuntimeError(f"a reader did not start or report within 300 s (exit codes {codes}): check that the "
                           "files are readable and that the machine is not out of memory") from None
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    nbytes = sum(path.stat().st_size for path in files)
    return {"seconds": best, "files": len(files), "files_per_s": len(files) / best, "mib_per_s": nbytes / 2**20 / best}


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
