"""A data set as tar shards: many samples per file, each file read from start to end (notebook 10).

A parallel file system serves a few large files far faster than many small ones (notebook 00
measured it), and a quota may count files as well as bytes. A shard is a plain tar file of
consecutive samples, each sample two members with the same key, ``{key}.png`` (the image, PNG:
lossless, decoded by the reader) and ``{key}.cls`` (its label as text): the layout of the
``webdataset`` package, which reads these shards too. ``shards.json`` beside them lists the shards.

:class:`ShardDataset` reads them in a ``DataLoader``: the shard list, shuffled by (seed, epoch), is
dealt out to every (rank, worker) pair, so each shard, and each sample, is read exactly once per
epoch across all ranks and workers; a shuffle buffer mixes the samples of the shards a reader holds.
"""

from __future__ import annotations

import io
import json
import os
import random
import tarfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch.utils.data import IterableDataset, get_worker_info

MANIFEST = "shards.json"
SHARD_NAME = "shard-{:06d}.tar"


def png_bytes(image: torch.Tensor) -> bytes:
    """One ``uint8 [C, H, W]`` image as the bytes of a PNG file."""
    from PIL import Image

    array = image.numpy()
    array = array[0] if array.shape[0] == 1 else array.transpose(1, 2, 0)  # [C, H, W] -> PIL's layout
    buffer = io.BytesIO()
    Image.fromarray(array).save(buffer, format="PNG")
    return buffer.getvalue()


def add_to_tar(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    """``data`` as the member ``name`` of an open tar file."""
    info = tarfile.TarInfo(name)
    info.size, info.mtime = len(data), 0  # mtime 0: the same images write the same bytes
    tar.addfile(info, io.BytesIO(data))


MIN_PER_SHARD, READERS_PLANNED, MAX_SHARD_BYTES = 100, 64, 256 * 2**20
# samples a reader mixes: a shard holds consecutive samples (written in class order, it would give batches of one
# class without it); the buffer holds the encoded images (PNG bytes), decoded as they leave it
SHUFFLE_BUFFER = 1000


def per_shard_for(samples: int, bytes_per_sample: float) -> int:
    """A shard size that suits a data set: at least 64 shards where the set allows it, so that up to
    64 readers (ranks x workers: 8 of Frontera's nodes x 4 GPUs x 2 workers) each start on a shard of
    their own; no fewer than 100 samples a shard, so that an open is paid for by many reads; and no
    shard over 256 MiB, so that a shard is never a large part of a node-local disk or of a reader's
    epoch. Any size trains on any number of readers (:func:`reader_spans`); this only makes it cheap."""
    size = max(MIN_PER_SHARD, -(-samples // READERS_PLANNED))
    return max(1, min(size, int(MAX_SHARD_BYTES // max(bytes_per_sample, 1.0)), samples))


def tar_bytes_per_sample(images: torch.Tensor) -> float:
    """About what one sample costs in a shard: its PNG, measured on up to 32 images, and two tar headers
    with the padding of the members to 512 bytes."""
    sizes = [len(png_bytes(image)) for image in images[:32]]
    return sum(sizes) / max(len(sizes), 1) + 3 * 512


def write_shards(images: torch.Tensor, labels: torch.Tensor, out: str | Path, per_shard: int,
                 source: str = "synthetic", progress: Callable[[int, int], None] | None = None) -> dict:
    """Write ``images`` (``uint8 [N, C, H, W]``) and ``labels`` as shards of ``per_shard`` samples in
    ``out``, and the manifest last: a folder with a manifest holds every shard it lists. Each shard is
    written under a temporary name and renamed when whole. ``progress(images written, images)`` after each."""
    if images.dtype != torch.uint8 or images.dim() != 4 or len(images) != len(labels):
        raise ValueError("images must be uint8 [N, C, H, W], one label each")
    if per_shard < 1:
        raise ValueError("per_shard must be at least 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    shards = []
    for number, start in enumerate(range(0, len(images), per_shard)):
        name = SHARD_NAME.format(number)
        partial = out / f".{name}.partial"
        with tarfile.open(partial, "w") as tar:
            for index in range(start, min(start + per_shard, len(images))):
                key = f"{index:08d}"
                add_to_tar(tar, f"{key}.png", png_bytes(images[index]))
                add_to_tar(tar, f"{key}.cls", str(int(labels[index])).encode())
        os.replace(partial, out / name)
        shards.append({"name": name, "samples": min(per_shard, len(images) - start),
                       "bytes": (out / name).stat().st_size})
        if progress is not None:
            progress(min(start + per_shard, len(images)), len(images))
    manifest = {"samples": len(images), "shape": list(images.shape[1:]), "format": "png", "source": source,
                "shards": shards}
    (out / f".{MANIFEST}.partial").write_text(json.dumps(manifest, indent=1))
    os.replace(out / f".{MANIFEST}.partial", out / MANIFEST)
    return manifest


def read_manifest(folder: str | Path) -> dict:
    path = Path(folder) / MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found: write the shards first (python -m course_utils.data shard "
                                f"... --out {folder})")
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        manifest = exc
    if not isinstance(manifest, dict) or not {"samples", "shards"} <= manifest.keys():
        raise ValueError(f"{path} is not a shard manifest (it lists no samples and shards): write the shards again "
                         f"(python -m course_utils.data shard ... --out {Path(folder).parent})")
    return manifest


def read_shard(path: str | Path) -> Iterator[tuple[str, torch.Tensor, int]]:
    """(key, ``uint8 [C, H, W]`` image, label) for each sample of one shard, in order."""
    for _, key, png, label in read_kept(path):
        yield key, _decode(png), label


def _decode(png: bytes) -> torch.Tensor:
    """[C, H, W] uint8, decoded by torchvision's libpng, as the one-file-per-image formats are: the formats then
    differ in how they are stored and read, not in their decoder."""
    from torchvision.io import decode_image

    return decode_image(torch.frombuffer(bytearray(png), dtype=torch.uint8))


def read_kept(path: str | Path, keep: Callable[[int], bool] | None = None,
               until: int | None = None) -> Iterator[tuple[int, str, bytes, int]]:
    """(position in the shard, key, PNG bytes, label) of the samples ``keep`` accepts, up to position
    ``until``; the others are passed over."""
    pending: dict[str, dict[str, bytes]] = {}
    position = 0
    with tarfile.open(path, "r") as tar:  # read front to back: one open, one sequential stream
        for member in tar:
            if until is not None and position >= until:
                break  # the rest of the shard is another reader's
            key, _, kind = member.name.partition(".")
            pending.setdefault(key, {})[kind] = tar.extractfile(member).read()
            if {"png", "cls"} <= pending[key].keys():
                sample = pending.pop(key)
                if keep is None or keep(position):
                    yield position, key, sample["png"], int(sample["cls"])
                position += 1


def emission_order(n: int, buffer: int, rng: random.Random) -> list[int]:
    """The order in which a shuffle buffer of ``buffer`` samples emits the positions 0..n-1 of the
    stream it reads: each new sample goes in, and once the buffer is full a random one comes out; the
    rest, shuffled, at the end. It depends on the counts alone, not on the samples, so a reader can
    plan it before it reads anything, and a resumed epoch can start part-way through it."""
    if buffer <= 1:
        return list(range(n))
    held: list[int] = []
    out: list[int] = []
    for position in range(n):
        held.append(position)
        if len(held) >= buffer:
            out.append(held.pop(rng.randrange(len(held))))
    rng.shuffle(held)
    return out + held


def batches_of_worker(batches: int, worker: int, workers: int) -> int:
    """How many of the first ``batches`` batches of an epoch came from ``worker`` of ``workers``: a
    DataLoader takes its batches from its workers in turn (batch i from worker i mod workers)."""
    return max(0, -(-(batches - worker) // workers))


def reader_spans(samples: int, world: int, workers: int, batch_size: int) -> list[list[tuple[int, int]]]:
    """Where each reader's samples lie in an epoch's stream of ``samples``: ``[rank][worker] = (start, stop)``.

    Each rank takes ``samples // world`` consecutive samples (every rank the same number, so DDP's ranks
    take the same steps; the ``samples % world`` at the stream's end, fewer than the ranks, wait for the
    next epoch, as with ``DistributedSampler(drop_last=True)``). A rank's samples make ``ceil(n / batch)``
    batches, the last possibly short; worker w makes batches w, w + workers, ... (the order a DataLoader
    takes them in), so it reads as many consecutive samples as those batches hold. Any number of shards
    of any sizes is dealt this way: a reader's span may start or end inside a shard."""
    if world < 1 or workers < 1 or batch_size < 1:
        raise ValueError("world, workers and batch_size must be at least 1")
    per_rank = samples // world
    batches = -(-per_rank // batch_size)
    last = per_rank - (batches - 1) * batch_size if batches else 0
    spans = []
    for rank in range(world):
        start, mine = rank * per_rank, []
        for worker in range(workers):
            count = batches_of_worker(batches, worker, workers) * batch_size
            if batches and (batches - 1) % workers == worker:
                count -= batch_size - last  # this worker makes the rank's last, short batch
            mine.append((start, start + count))
            start += count
        spans.append(mine)
    return spans


class ShardDataset(IterableDataset):
    """The samples of the shards in ``folder``, each read at most once per epoch across every rank and worker.

    ``rank``/``world`` default to the process group's (one process: 0 and 1). The shard list is
    shuffled by (``seed``, epoch) the same way in every process (``set_epoch``, as for a
    DistributedSampler); the samples of the shards in that order form the epoch's stream, which
    :func:`reader_spans` deals out to the ``world`` x ``workers`` readers in consecutive spans, so any
    number of shards, of any sizes, trains on any number of ranks and workers, every rank taking the same
    number of steps. A reader opens only the shards its span touches, and decodes only its own samples.
    ``buffer`` > 1 (default ``SHUFFLE_BUFFER``) mixes a reader's samples through a shuffle buffer of that size
    (:func:`emission_order`); 0 reads them in the shards' order.
    Images come out as float, normalised by ``mean``/``std``; with ``keys`` each sample also carries
    its key. The batch size comes with :meth:`set_epoch` (``make_loader`` passes it); in a DataLoader, do
    not keep workers alive across epochs (``persistent_workers``): each worker holds a copy of the
    dataset, which a later :meth:`set_epoch` would not reach.
    """

    def __init__(self, folder: str | Path, mean: tuple[float, ...], std: tuple[float, ...], seed: int = 0,
                 buffer: int = SHUFFLE_BUFFER, rank: int | None = None, world: int | None = None,
                 keys: bool = False) -> None:
        super().__init__()
        self.folder, self.manifest = Path(folder), read_manifest(folder)
        self.mean = torch.tensor(mean).view(-1, 1, 1)
        self.std = torch.tensor(std).view(-1, 1, 1)
        self.seed, self.buffer, self.keys = seed, buffer, keys
        self.set_epoch(0)
        self.decoded = 0  # samples decoded by this copy of the dataset (in one process: all of them)
        if rank is None or world is None:
            import torch.distributed as dist

            initialized = dist.is_available() and dist.is_initialized()
            rank, world = (dist.get_rank(), dist.get_world_size()) if initialized else (0, 1)
        self.rank, self.world = rank, world
        if self.manifest["samples"] < world:
            raise ValueError(f"{self.folder} holds {self.manifest['samples']} samples, fewer than the {world} ranks: "
                             "write more (python -m course_utils.data shard -n N) or use fewer ranks")

    def set_epoch(self, epoch: int, skip_batches: int = 0, batch_size: int = 1) -> None:
        """Read epoch ``epoch`` in batches of ``batch_size``, after the first ``skip_batches`` (a resumed
        mid-epoch checkpoint): the shards those batches came from are not opened again, and no sample
        they held is decoded again."""
        self.epoch, self.skip_batches, self.batch_size = epoch, skip_batches, batch_size

    def __len__(self) -> int:
        """Samples per rank and epoch (:func:`reader_spans`)."""
        return self.manifest["samples"] // self.world

    def shard_order(self) -> list[str]:
        """This epoch's shards in stream order: the same in every reader."""
        names = [s["name"] for s in self.manifest["shards"]]
        random.Random(f"{self.seed}-{self.epoch}").shuffle(names)
        return names

    def plan(self, worker: int, workers: int) -> list[tuple[str, int, int]]:
        """What reader (this rank, ``worker`` of ``workers``) reads this epoch: (shard, first sample, stop)."""
        sizes = {s["name"]: s["samples"] for s in self.manifest["shards"]}
        lo, hi = reader_spans(self.manifest["samples"], self.world, workers, self.batch_size)[self.rank][worker]
        out, start = [], 0
        for name in self.shard_order():
            first, stop = max(lo, start) - start, min(hi, start + sizes[name]) - start
            if first < stop:
                out.append((name, first, stop))
            start += sizes[name]
        return out

    def shards_for(self, worker: int, workers: int) -> list[str]:
        """The shards reader (this rank, ``worker`` of ``workers``) opens this epoch (whole or in part)."""
        return [name for name, _, _ in self.plan(worker, workers)]

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        workers = info.num_workers if info else 1
        # a DataLoader takes batch i from worker i mod workers, starting at worker 0, also in a resumed
        # epoch: the worker that starts it plays the reader whose batch comes next
        worker = (info.id + self.skip_batches) % workers if info else 0
        parts = self.plan(worker, workers)
        order = emission_order(sum(stop - first for _, first, stop in parts), self.buffer,
                               random.Random(f"{self.seed}-{self.epoch}-{self.rank}-{worker}"))
        order = order[batches_of_worker(self.skip_batches, worker, workers) * self.batch_size:]
        needed, held, next_out, start = set(order), {}, 0, 0
        for name, first, stop in parts:  # read in order; hold what comes out later (about a buffer's worth)
            if any(p in needed for p in range(start, start + stop - first)):  # else: not even opened
                keep = lambda i, s=start - first: first <= i < stop and s + i in needed  # noqa: E731
                for position, key, png, label in read_kept(self.folder / name, keep=keep, until=stop):
                    held[start + position - first] = (key, png, label)  # encoded: a buffer costs its PNGs' bytes
                    while next_out < len(order) and order[next_out] in held:
                        yield self._out(held.pop(order[next_out]))
                        next_out += 1
            start += stop - first

    def _out(self, sample: tuple) -> tuple:
        key, png, label = sample
        self.decoded += 1
        image = (_decode(png).float().div_(255) - self.mean) / self.std
        return (key, image, label) if self.keys else (image, label)
