"""Notebook 10: the formats read, readers at once, the workers' rule under the DLIO method, the shuffle buffer,
WebDataset's deal, a staged job and a staged copy."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from ..claims import verify

PLACES = ("shared", "node-local")


def check_formats(written: Mapping, reads: Mapping, n_images: int, per_shard: int) -> None:
    """Each format written and read for one epoch on each storage (``written``/``reads`` by (place, format))."""
    verify([
        (f"the array format is 2 files and the shards {math.ceil(n_images / per_shard)} tar files and a manifest, "
         f"for {n_images:,} images", written["node-local", "npy"].files == 2
         and written["node-local", "shards"].files == math.ceil(n_images / per_shard) + 1),
        ("on both storages the memory-mapped array read faster than the PNG files: nothing to decode",
         all(reads[p, "npy"]["images_per_s"] > reads[p, "png"]["images_per_s"] for p in PLACES)),
    ], detail=lambda: str({k: round(v["images_per_s"]) for k, v in reads.items()}))


def check_readers_at_once(at_once: Mapping, readers: Sequence[int]) -> None:
    """Images per second, all readers together, by (place, format, readers)."""
    verify([(f"a few shards read front to back delivered more images per second than a file per image, with "
             f"{', '.join(map(str, readers))} readers, on both storages",
             all(at_once[p, "shards", n] > at_once[p, "png", n] for p in PLACES for n in readers))],
           detail=lambda: str({k: round(v) for k, v in at_once.items()}))


def check_workers_rule(au: Mapping[str, Mapping[int, float]], compute: Mapping[str, float], worker_ms: float,
                       handover_ms: float, workers: Sequence[int], cores: int, expected: float) -> None:
    """The DLIO runs: accelerator utilisation ``au[case][workers]`` for each compute time ``compute[case]`` (ms).
    The rule's ceil(worker_ms / compute_ms) workers are judged only where each has a core and the training process
    one more; DLIO's bar only where the hand-over leaves room for it (a step of 20 hand-overs or more)."""
    kept, short, busy = [], [], []
    judged = {"kept": 0, "busy": 0, "short": 0}  # a claim no case here could test is said, not ticked
    for name, compute_ms in compute.items():
        need = max(1, math.ceil(worker_ms / compute_ms))
        more = [w for w in workers if w > need]
        if need in workers and need <= cores - 1 and more:
            judged["kept"] += 1
            if au[name][need] < max(au[name][w] for w in more) - 0.15:
                kept.append(name)
            if compute_ms >= 20 * handover_ms:
                judged["busy"] += 1
                if au[name][need] < expected:
                    busy.append(name)
    for ratio in (0.8, 1.6, 3.2):  # the cases named after worker_ms / ratio
        name = f"worker_ms / {ratio:g}"
        fewer = max(w for w in workers if w < math.ceil(ratio))
        if name in au:
            judged["short"] += 1
            if au[name][fewer] >= expected:
                short.append(name)
    claims = {"kept": ("where the cores allow, the rule's workers kept the device as busy as more workers did", not kept),
              "busy": (f"the rule's workers reached DLIO's {expected:.0%} where the hand-over leaves room for it",
                       not busy),
              "short": (f"one worker fewer than the rule asks fell short of {expected:.0%}", not short)}
    why = {"kept": "no case had the rule's workers and more within the cores",
           "busy": f"no case's compute was 20 hand-overs ({20 * handover_ms:.1f} ms) or more"}
    for key in [k for k in claims if not judged[k] and k in why]:
        print(f"- not judged on this run: {claims.pop(key)[0]} ({why[key]})")
    if not judged["short"]:
        claims["short"] = ("a case named worker_ms / 0.8, 1.6 or 3.2 was run", False)
    verify(list(claims.values()), detail=lambda: f"utilisation by case and workers: {dict(au)}")


def check_shuffle_buffer(mix: Mapping[int, Sequence[int]], small: int, buffer: int, run: int) -> None:
    """Classes per batch from shards written in class order (``run`` images of a class in a row), read without a
    buffer (0), with a ``small`` one and with ``buffer``."""
    none, few, some = (sum(mix[b]) / len(mix[b]) for b in (0, small, buffer))
    verify([
        (f"without a buffer a batch comes from one or two shards: {none:.1f} classes a batch", none < 3),
        (f"a buffer of {small}, shorter than a class's run of about {run}, mixes less: {few:.1f} a batch", few < some),
        (f"the buffer of {buffer} mixes the classes of the samples it holds: {some:.1f} a batch", some > 2 * none),
    ])


def check_webdataset(first_same: bool, dealt: Mapping[int, int], drawn: Mapping[int, Sequence[str]], n_images: int,
                     per_rank: int) -> None:
    """WebDataset on the course's shards: its first sample, ``split_by_node``'s counts per rank, and the samples
    each rank drew with ``resampled=True`` and ``.with_epoch(per_rank)``."""
    verify([
        ("WebDataset read the course's shards as they are: its first sample is the first image written", first_same),
        (f"split_by_node dealt whole shards: each of the {n_images:,} samples once, uneven counts per rank",
         sum(dealt.values()) == n_images and len(set(dealt.values())) > 1),
        (f"resampled with .with_epoch({per_rank}) gave every rank {per_rank} samples",
         all(len(keys) == per_rank for keys in drawn.values())),
    ])


def check_staged_job(record: Mapping, staged: Sequence[Mapping], hosts: Sequence[str], log: str) -> None:
    """The multi_node_srun pattern with COURSE_STAGE: its record, the staging lines of its log, its ranks' hosts."""
    verify([
        (f"the job completed on {record['NodeList']}", record["JobState"] == "COMPLETED"),
        ("data/stage.sh ran one task on each node the ranks ran on",
         sorted(c["node"] for c in staged) == sorted(hosts)),
    ], detail=log[-3000:])


def check_staged_copy(copied_files: int, source_files: int) -> None:
    """data/stage.sh --copy, run on this machine: file counts of the copy and of the folder it copied."""
    verify([(f"the copy holds every file of the folder: {copied_files} of {source_files}", copied_files == source_files)])
