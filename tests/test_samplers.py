"""Length-bucketed and image-grouped batch samplers, and the (seed, epoch) shuffle."""

from __future__ import annotations

import numpy as np
from torch.utils.data.distributed import DistributedSampler

from captioning.data.samplers import BucketBatchSampler, EpochShuffleSampler, ImageBatchSampler


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 20, size=n)


def test_bucket_sampler_covers_each_item_once_per_epoch() -> None:
    lengths = _lengths(103)
    inner = EpochShuffleSampler(103, seed=1)
    sampler = BucketBatchSampler(inner, 8, lengths=lengths, seed=1, bucket_size_multiplier=4)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 13
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(103))
        for b in batches:  # each batch is a run of a length-sorted pool
            assert list(lengths[b]) == sorted(lengths[b], reverse=True)
        epochs.append(batches)
    assert epochs[0] != epochs[1]
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # deterministic given (seed, epoch)
    # Bucketing groups similar lengths: far less spread than random batches.
    spread = np.mean([np.ptp(lengths[b]) for b in epochs[0] if len(b) == 8])
    assert spread < 6


def test_bucket_sampler_drop_last() -> None:
    sampler = BucketBatchSampler(range(21), 4, True, lengths=_lengths(21),
                                 bucket_size_multiplier=2)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 5 and all(len(b) == 4 for b in batches)


def test_bucket_sampler_shards_disjointly_across_replicas() -> None:
    n, lengths = 100, _lengths(100)
    shards = []
    for rank in range(2):
        inner = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler = BucketBatchSampler(inner, 6, lengths=lengths, bucket_size_multiplier=3)
        sampler.set_epoch(2)
        assert inner.epoch == 2
        batches = list(sampler)
        assert len(batches) == len(sampler)
        shards.append([i for b in batches for i in b])
    assert len(list(BucketBatchSampler(DistributedSampler(range(n), num_replicas=2, rank=0),
                                       6, lengths=lengths))) == len(sampler)
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(n))


def _images(n_images: int, seed: int = 0) -> np.ndarray:
    """The image of each pair: 5 to 7 captions an image (as in COCO), pairs in random order."""
    counts = np.random.default_rng(seed).integers(5, 8, size=n_images)
    return np.random.default_rng(seed + 1).permutation(np.repeat(np.arange(n_images), counts))


def test_image_sampler_keeps_each_images_captions_together() -> None:
    images = _images(40)
    sampler = ImageBatchSampler(EpochShuffleSampler(len(images), seed=3), 16, images=images,
                                seed=3)
    epochs = []
    for epoch in range(2):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == -(-len(images) // 16)
        assert sorted(i for b in batches for i in b) == list(range(len(images)))
        # An image's pairs are cut only at a batch's edge: it spans at most two batches, and a
        # batch holds about batch_size / 6 images, not 16.
        spans = [sum(image in set(images[b]) for b in batches) for image in range(40)]
        assert max(spans) <= 2 and sum(s == 2 for s in spans) <= len(batches)
        assert max(len(set(images[b])) for b in batches) <= 16 // 5 + 2
        epochs.append(batches)
    assert epochs[0] != epochs[1]
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # deterministic given (seed, epoch)
    sampler.start = 2  # resuming within the epoch skips the batches already trained on
    assert list(sampler) == epochs[1][2:]


def test_image_sampler_puts_images_of_similar_longest_captions_together() -> None:
    images = _images(300, seed=5)
    rng = np.random.default_rng(6)  # each image's captions: its own length, give or take 2
    lengths = rng.integers(5, 21, size=300)[images] + rng.integers(0, 3, size=len(images))
    steps = {}
    for name, given in (("sorted", lengths), ("unsorted", None)):
        sampler = ImageBatchSampler(range(len(images)), 30, images=images, lengths=given,
                                    bucket_size_multiplier=20)
        batches = list(sampler)
        assert sorted(i for b in batches for i in b) == list(range(len(images)))
        steps[name] = np.mean([lengths[b].max() for b in batches])  # a batch's word steps
    assert steps["sorted"] < steps["unsorted"] - 3, steps


def test_image_sampler_shards_equal_shares_across_replicas() -> None:
    images = _images(31)
    n = len(images)
    shares = []
    for rank in range(3):
        inner = DistributedSampler(range(n), num_replicas=3, rank=rank, shuffle=True, seed=0)
        sampler = ImageBatchSampler(inner, 8, images=images)
        sampler.set_epoch(4)
        batches = list(sampler)
        assert len(batches) == len(sampler)  # every rank hands out the same number
        shares.append([i for b in batches for i in b])
    assert len({len(s) for s in shares}) == 1
    everything = [i for s in shares for i in s]
    assert sorted(set(everything)) == list(range(n))  # every pair, once but for the padding
    assert len(everything) - n == -n % 3 == len(everything) - len(set(everything))


def test_image_sampler_drop_last() -> None:
    images = np.repeat(np.arange(5), 5)  # 25 pairs
    batches = list(ImageBatchSampler(range(25), 10, True, images=images))
    assert len(batches) == 2 and all(len(b) == 10 for b in batches)
