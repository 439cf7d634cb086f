"""DataLoaders that are right under any launcher, and resume mid-epoch."""

from __future__ import annotations

import itertools
import warnings

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .. import process_group as cdist
from .shards import ShardDataset


def make_loader(
    dataset: Dataset,
    batch_size: int,
    shuffle: bool = True,
    workers: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    drop_last: bool = False,
    seed: int = 0,
    replica: tuple[int, int] | None = None,
    stateful: bool = False,
) -> DataLoader:
    """A DataLoader that is right under any launcher.

    It uses a ``DistributedSampler`` whenever it shuffles or runs on several
    ranks: each rank sees a disjoint 1/world-size slice, and the order of
    epoch ``e`` depends only on ``(seed, e)`` -- call :func:`set_epoch` every
    epoch -- so a job resumed from a checkpoint sees exactly the batches the
    uninterrupted job would have. ``batch_size`` is per rank. ``replica``: (which model replica
    this process serves, how many replicas share the data), when that is not (rank, world size):
    ``(0, 1)`` for the stages of one pipeline, which all read every batch. ``stateful``: torchdata's
    ``StatefulDataLoader``, a DataLoader with ``state_dict()`` that Lightning saves in its checkpoints and
    restores, so a run stopped mid-epoch resumes with the batches the epoch had left.
    """
    sampler = None
    index, world = (cdist.get_rank(), cdist.get_world_size()) if replica is None else replica
    streamed = isinstance(dataset, IterableDataset)  # shards: the dataset deals itself out (set_epoch)
    if streamed:
        persistent_workers = False  # each worker's copy of the dataset must see every set_epoch
        if isinstance(dataset, ShardDataset):
            dataset.batch_size = batch_size  # its readers' spans follow the batches (set_epoch keeps it up to date)
    elif shuffle or world > 1:
        sampler = ResumableSampler(
            dataset, num_replicas=world, rank=index, shuffle=shuffle, seed=seed,
            drop_last=drop_last,
        )
    kwargs: dict = {}
    if workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
    loader_class = DataLoader
    if stateful:
        from torchdata.stateful_dataloader import StatefulDataLoader as loader_class
    with warnings.catch_warnings():  # torchdata 0.11 calls torch.set_vital, which torch 2.14 retired
        warnings.filterwarnings("ignore", message="'set_vital' is deprecated")
        loader = loader_class(
            dataset,
            batch_size=batch_size,
            sampler=sampler,
            num_workers=workers,
            pin_memory=pin_memory,
            drop_last=drop_last,
            generator=torch.Generator().manual_seed(seed),
            **kwargs,
        )
    loader.course_seed = seed  # type: ignore[attr-defined]  # read by set_epoch
    return loader


class ResumableSampler(DistributedSampler):
    """A ``DistributedSampler`` that can start an epoch part-way through, for a job
    resumed from a mid-epoch checkpoint: the same order, minus what was trained.

    Its ``state_dict`` (the epoch, and the indices of it handed out) is what torchdata's
    ``StatefulDataLoader`` saves for it, and Lightning with it: a Lightning run resumed mid-epoch
    builds its loader's iterator before it sets the epoch, so the epoch must come back with the state."""

    skip = 0  # samples of this rank's slice already used in this epoch (the course's Trainer: len() is the rest)
    restored = 0  # the same, restored by a StatefulDataLoader (Lightning: len() stays the whole epoch's)
    handed_out = 0  # by the current iterator

    def __iter__(self):
        self.handed_out = 0
        for index in itertools.islice(super().__iter__(), self.skip + self.restored, None):
            self.handed_out += 1
            yield index

    def __len__(self) -> int:
        return max(0, super().__len__() - self.skip)

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:  # a new epoch starts at its beginning
            self.skip = self.restored = 0
        super().set_epoch(epoch)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "done": self.skip + self.restored + self.handed_out}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.skip, self.restored = state["epoch"], 0, state["done"]


def set_epoch(loader: DataLoader, epoch: int, skip_batches: int = 0) -> bool:
    """Make ``epoch``'s order and worker seeds a function of (seed, epoch) only.

    ``skip_batches``: start after that many batches of the epoch (a resumed
    mid-epoch checkpoint). Returns False when this loader cannot skip (not one
    of :func:`make_loader`'s), so the caller must skip by reading batches.
    """
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(epoch)
    seed = getattr(loader, "course_seed", None)
    if seed is not None and loader.generator is not None:
        # worker processes draw their augmentation seeds from this generator
        loader.generator.manual_seed(seed * 100_003 + epoch)
    if isinstance(loader.sampler, ResumableSampler):
        loader.sampler.skip = skip_batches * (loader.batch_size or 1)
        return True
    if isinstance(loader.dataset, IterableDataset) and hasattr(loader.dataset, "set_epoch"):
        loader.dataset.set_epoch(epoch, skip_batches, loader.batch_size or 1)  # shards.ShardDataset
        return True
    return skip_batches == 0
