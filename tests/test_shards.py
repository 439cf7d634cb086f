"""Tar shards (course_utils.data.shards): written once, read exactly once per epoch across ranks and
DataLoader workers, the real MNIST test set round-tripped bit for bit when ../shared has it."""

import subprocess
import sys
from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from course_utils.data import INFO, make_synthetic
from course_utils.data.shards import (ShardDataset, batches_of_worker, per_shard_for, read_manifest, read_shard,
                                     reader_spans, write_shards)
from course_utils.data.sources import raw_images
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
        assert resumed == whole[5:] and len(whole) == 15, (rank, len(whole))  # 120 samples a rank
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


@pytest.mark.parametrize("samples, world", [(50_000, 4), (50_000, 8), (10_000, 4), (10_000, 8), (10_001, 3)])
def test_any_number_of_samples_is_dealt_to_any_ranks_and_workers_with_equal_steps(samples, world):
    """CIFAR-10's 50,000 images (50 shards of 1,000) and notebook 10's 10,000 (40 shards, the last of 16)
    on FT3's 4 ranks and Frontera's 8, with 1-4 workers each: the spans cover the stream once, every rank
    makes the same number of batches, and each worker reads exactly what its batches hold in the order a
    DataLoader takes them (batch i from worker i mod workers)."""
    for workers in (1, 2, 3, 4):
        for batch in (1, 64, 256):
            spans = reader_spans(samples, world, workers, batch)
            flat = [span for rank in spans for span in rank]
            assert flat[0][0] == 0 and all(a[1] == b[0] for a, b in zip(flat, flat[1:])), "consecutive, no overlap"
            assert flat[-1][1] == samples - samples % world, "all but the remainder, fewer than the ranks"
            per_rank = samples // world
            steps = -(-per_rank // batch)
            for rank in spans:
                assert sum(b - a for a, b in rank) == per_rank
                for worker, (a, b) in enumerate(rank):
                    mine = batches_of_worker(steps, worker, workers)
                    last = steps and (steps - 1) % workers == worker
                    assert b - a == mine * batch - (steps * batch - per_rank if last else 0)


def test_fifty_shards_train_on_four_ranks_by_two_workers_and_a_short_last_shard_on_three(tmp_path):
    """Real readers (DataLoader worker processes): 50 shards over 4 ranks x 2 workers, every sample once
    and every rank the same number of batches; 10 shards of 7 and one of 3 over 3 ranks x 2 workers, each
    sample at most once, the remainder (73 mod 3 = 1) left for the next epoch, equal steps."""
    def epoch(folder, world, workers, batch):
        per_rank = []
        for rank in range(world):
            ds = ShardDataset(folder, *STATS, rank=rank, world=world, keys=True)
            ds.set_epoch(0, batch_size=batch)
            per_rank.append([list(keys) for keys, _, _ in DataLoader(ds, batch_size=batch, num_workers=workers)])
        return per_rank

    images, labels = make_synthetic(200, seed=5)
    write_shards(images, labels, tmp_path / "fifty", per_shard=4)
    per_rank = epoch(tmp_path / "fifty", 4, 2, 8)
    keys = Counter(k for rank in per_rank for batch in rank for k in batch)
    assert len(keys) == 200 and set(keys.values()) == {1}
    assert [len(rank) for rank in per_rank] == [7] * 4, "50 samples a rank: 7 batches of 8 (the last of 2)"
    write_shards(images[:73], labels[:73], tmp_path / "short", per_shard=7)  # 7 x 10, then 3
    per_rank = epoch(tmp_path / "short", 3, 2, 5)
    keys = Counter(k for rank in per_rank for batch in rank for k in batch)
    assert len(keys) == 72 and set(keys.values()) == {1}
    assert [len(rank) for rank in per_rank] == [5] * 3


def test_the_shard_size_suits_the_data_set():
    """CIFAR-10 (50,000 PNGs of ~2.3 KiB): 64 shards, one for each of up to 64 readers; a small set: 100 a
    shard; ImageNet-sized JPEGs (~110 KiB): shards stay under 256 MiB."""
    assert per_shard_for(50_000, 3_600) == 782 and -(-50_000 // 782) == 64
    assert per_shard_for(512, 3_600) == 100 and per_shard_for(40, 3_600) == 40
    big = per_shard_for(1_281_167, 110 * 2**10)
    assert big * 110 * 2**10 <= 256 * 2**20 < (big + 1) * 110 * 2**10


def test_a_corrupt_manifest_is_named_with_what_to_do(shards, tmp_path):
    (tmp_path / "train").mkdir()
    (tmp_path / "train" / "shards.json").write_text("")
    with pytest.raises(ValueError, match=r"train/shards.json is not a shard manifest.*--out " + str(tmp_path)):
        ShardDataset(tmp_path / "train", *STATS)


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


def test_a_long_shard_write_says_where_it_is(tmp_path, capsys):
    """write_shards reports after each shard; the command line prints that at most every so many seconds, and not
    for the last shard (its summary line follows)."""
    from course_utils.data.__main__ import _every

    images, labels = make_synthetic(70, seed=0)
    seen = []
    write_shards(images, labels, tmp_path / "a", per_shard=30, progress=lambda done, total: seen.append((done, total)))
    assert seen == [(30, 70), (60, 70), (70, 70)]
    write_shards(images, labels, tmp_path / "b", per_shard=30, progress=_every(0, "train: {} of {} images written"))
    assert capsys.readouterr().out.splitlines() == ["train: 30 of 70 images written", "train: 60 of 70 images written"]
    write_shards(images, labels, tmp_path / "c", per_shard=30, progress=_every(3600, "train: {} of {} images"))
    assert capsys.readouterr().out == "", "a write shorter than the interval prints nothing"
