"""Length-bucketed batch sampler and the (seed, epoch) shuffle."""

from __future__ import annotations

import numpy as np
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
