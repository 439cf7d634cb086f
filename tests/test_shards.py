"""Tar shards (course_utils.data.shards): written once, read exactly once per epoch across ranks and
DataLoader workers, the real MNIST test set round-tripped bit for bit when ../shared has it."""

import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from course_utils.data import INFO, make_synthetic
from course_utils.data.shards import ShardDataset, raw_images, read_manifest, read_shard, write_shards
from course_utils.paths import REPO_ROOT

MNIST_DIR = REPO_ROOT.parent / "shared" / "data" / "mnist-t10k"
STATS = INFO["synthetic"].mean, INFO["synthetic"].std


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    images, labels = make_synthetic(240, seed=3)
    folder = tmp_path_factory.mktemp("shards")
    write_shards(images, labels, folder, per_shard=30)  # 8 shards
    return folder, images, labels


def _keys(folder, rank, world, epoch, workers, buffer=0):
    ds = ShardDataset(folder, *STATS, rank=rank, world=world, keys=True, buffer=buffer)
    ds.set_epoch(epoch)
    loader = DataLoader(ds, batch_size=None, num_workers=workers)  # real worker processes
    return [key for key, _, _ in loader]


def test_every_sample_is_read_once_per_epoch_across_two_ranks_and_two_workers(shards):
    folder, images, _ = shards
    seen = {}
    for epoch in (0, 1):
        per_rank = [_keys(folder, rank, 2, epoch, workers=2, buffer=16) for rank in (0, 1)]
        everything = Counter(per_rank[0] + per_rank[1])
        assert set(everything.values()) == {1} and len(everything) == len(images), "each sample once, none missed"
        assert len(per_rank[0]) == len(per_rank[1]), "both ranks read as many samples (DDP's steps agree)"
        seen[epoch] = per_rank[0]
    assert set(seen[0]) != set(seen[1]), "a new epoch deals other shards to rank 0"


def test_a_resumed_epoch_goes_on_where_it_stopped_and_decodes_no_sample_twice(shards):
    """Stopped after 5 batches of 8 (2 ranks, 2 real workers each, a shuffle buffer of 16), the epoch
    resumed from there yields exactly the batches the uninterrupted epoch had left, in their order;
    read in one process, it decodes only the samples it yields."""
    folder, _, _ = shards

    def batches(rank, workers, skip=0):
        ds = ShardDataset(folder, *STATS, rank=rank, world=2, keys=True, buffer=16)
        ds.set_epoch(1, skip_batches=skip, batch_size=8)
        return [list(keys) for keys, _, _ in DataLoader(ds, batch_size=8, num_workers=workers)], ds

    for rank in (0, 1):
        whole, _ = batches(rank, workers=2)
        resumed, _ = batches(rank, workers=2, skip=5)
        assert resumed == whole[5:] and len(whole) == 16, (rank, len(whole))
    whole, _ = batches(0, workers=0)
    tail, ds = batches(0, workers=0, skip=5)
    assert tail == whole[5:]
    assert ds.decoded == sum(len(b) for b in tail) == 120 - 40, "nothing trained before the stop is decoded again"


def test_samples_come_back_as_written(shards):
    folder, images, labels = shards
    manifest = read_manifest(folder)
    key, image, label = next(read_shard(folder / manifest["shards"][2]["name"]))
    assert key == f"{60:08d}" and torch.equal(image, images[60]) and label == int(labels[60])
    x, y = next(iter(ShardDataset(folder, *STATS, rank=0, world=1)))
    assert x.dtype == torch.float32 and x.shape == images.shape[1:]


def test_a_layout_that_cannot_be_dealt_out_evenly_says_how_to_fix_it(shards, tmp_path):
    folder, images, labels = shards
    with pytest.raises(ValueError, match="cannot be dealt out evenly to 3 rank.s. x 1 worker.s.: write a multiple of 3"):
        _keys(folder, 0, 3, 0, workers=0)
    write_shards(images[:70], labels[:70], tmp_path, per_shard=30)  # 30, 30, 10
    with pytest.raises(ValueError, match="differ in size"):
        _keys(tmp_path, 0, 3, 0, workers=0)


def test_the_command_line_writes_shards_and_a_missing_data_set_is_one_line(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "course_utils.data", "shard", *a],  # noqa: E731
                                    capture_output=True, text=True, cwd=REPO_ROOT)
    ok = run("synthetic", "-n", "100", "--n-val", "50", "--per-shard", "25", "--out", str(tmp_path / "s"))
    assert ok.returncode == 0 and "train: 100 images of synthetic in 4 shard(s)" in ok.stdout, ok.stderr
    assert [s["samples"] for s in read_manifest(tmp_path / "s" / "train")["shards"]] == [25] * 4
    assert [s["samples"] for s in read_manifest(tmp_path / "s" / "val")["shards"]] == [25] * 2
    missing = run("cifar10", "--root", str(tmp_path / "nothing"), "--out", str(tmp_path / "c"))
    assert missing.returncode == 1 and "python -m course_utils.data download cifar10" in missing.stderr
    assert "Traceback" not in missing.stderr


@pytest.mark.skipif(not (MNIST_DIR / "t10k-images-idx3-ubyte.gz").exists(),
                    reason=f"real MNIST test set not found at {MNIST_DIR} (only the course's CI has ../shared)")
def test_the_real_mnist_test_set_round_trips_through_shards(tmp_path):
    images, labels = raw_images("mnist-idx", MNIST_DIR)
    write_shards(images, labels, tmp_path, per_shard=1000)
    back = [sample for shard in read_manifest(tmp_path)["shards"] for sample in read_shard(tmp_path / shard["name"])]
    assert len(back) == 10_000 == len(images)
    assert torch.equal(torch.stack([image for _, image, _ in back]), images), "PNG is lossless: the same pixels"
    assert [label for _, _, label in back] == labels.tolist()
