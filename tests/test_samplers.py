"""Length-bucketed batch sampler and the (seed, epoch) shuffle."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data.distributed import DistributedSampler

from captioning.data.samplers import BucketBatchSampler, EpochShuffleSampler


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


def test_grouped_batches_put_an_images_captions_of_one_length_together() -> None:
    """With `groups`, ties in length go by image: batches are as bucketed as without (the same
    length-sorted runs), an image's captions of one length sit side by side, and a batch holds
    fewer distinct images. Every caption lands in exactly one batch, in a (seed, epoch) order."""
    images, per = 60, 5
    groups = np.repeat(np.arange(images), per)  # caption -> image
    lengths = np.random.default_rng(3).integers(8, 11, size=images * per)  # 3 lengths: ties
    grouped, plain = (BucketBatchSampler(EpochShuffleSampler(len(groups), seed=0), 10,
                                         lengths=lengths, seed=0, groups=g,
                                         bucket_size_multiplier=1000) for g in (groups, None))
    runs = []
    for epoch in (0, 1):
        grouped.set_epoch(epoch)
        plain.set_epoch(epoch)
        batches = list(grouped)
        assert sorted(i for b in batches for i in b) == list(range(len(groups)))
        assert sorted(sorted(lengths[b].tolist()) for b in batches) == \
            sorted(sorted(lengths[b].tolist()) for b in plain)  # the same bucketing
        for b in batches:
            assert list(lengths[b]) == sorted(lengths[b], reverse=True)
            keys = list(zip(lengths[b].tolist(), groups[b].tolist()))
            runs_of = [k for i, k in enumerate(keys) if i == 0 or k != keys[i - 1]]
            assert len(runs_of) == len(set(keys))  # each (length, image) is one run
        distinct = np.mean([len(np.unique(groups[b])) for b in batches])
        assert distinct < np.mean([len(np.unique(groups[b])) for b in plain]) - 2
        runs.append(batches)
    assert runs[0] != runs[1]
    grouped.set_epoch(0)
    assert list(grouped) == runs[0]


def test_grouped_batches_refuse_groups_of_another_size() -> None:
    with pytest.raises(ValueError, match="groups has 3 entries for 4 lengths"):
        BucketBatchSampler(range(4), 2, lengths=[3, 4, 5, 6], groups=[0, 0, 1])
