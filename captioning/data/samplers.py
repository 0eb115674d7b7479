"""Training samplers: a (seed, epoch)-determined shuffle and length-bucketed batches."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
from torch.utils.data import BatchSampler, RandomSampler, Sampler


class EpochShuffleSampler(RandomSampler):
    """A random permutation of range(n) that depends only on (seed, epoch); call `set_epoch`.

    It is a `RandomSampler`, so under DDP Lightning replaces it by a shuffling
    `DistributedSampler` (and calls that one's `set_epoch`).
    """

    def __init__(self, n: int, *, seed: int = 0) -> None:
        super().__init__(range(n))
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        yield from np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist()


class BucketBatchSampler(BatchSampler):
    """Length-bucketed batches (cf. Xu et al. 2015, training procedure: minibatches of captions
    of one length).

    The indices of `sampler` (already shuffled, and sharded under DDP) are cut into pools of
    `batch_size * bucket_size_multiplier`; each pool is sorted by length and cut into batches,
    and the batch order is shuffled with (seed, epoch). Every index the sampler yields lands in
    exactly one batch. The epoch is taken from `sampler.epoch` when it has one (Lightning calls
    `set_epoch` on the inner sampler), so all ranks agree. Under Lightning DDP the `sampler`
    argument is replaced by a `DistributedSampler`, giving each rank a disjoint shard (padded by
    repetition when the size does not divide, like any DistributedSampler).
    """

    def __init__(self, sampler: Sampler[int] | Sequence[int], batch_size: int,
                 drop_last: bool = False, *, lengths: Sequence[int] | np.ndarray,
                 seed: int = 0, shuffle: bool = True, bucket_size_multiplier: int = 100) -> None:
        super().__init__(sampler, batch_size, drop_last)
        if bucket_size_multiplier < 1:
            raise ValueError("bucket_size_multiplier must be >= 1")
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.seed, self.shuffle, self._epoch = seed, shuffle, 0
        self.bucket_size_multiplier = bucket_size_multiplier

    @property
    def epoch(self) -> int:
        return int(getattr(self.sampler, "epoch", self._epoch))

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        if callable(getattr(self.sampler, "set_epoch", None)):
            self.sampler.set_epoch(epoch)

    def __len__(self) -> int:
        n, b = len(self.sampler), self.batch_size
        full, rest = divmod(n, b * self.bucket_size_multiplier)
        tail = rest // b if self.drop_last else -(-rest // b)
        return full * self.bucket_size_multiplier + tail

    def __iter__(self) -> Iterator[list[int]]:
        idx = np.fromiter(iter(self.sampler), dtype=np.int64)
        b, pool = self.batch_size, self.batch_size * self.bucket_size_multiplier
        batches: list[list[int]] = []
        for start in range(0, len(idx), pool):
            chunk = idx[start: start + pool]
            chunk = chunk[np.argsort(-self.lengths[chunk], kind="stable")]
            for s in range(0, len(chunk), b):
                batch = chunk[s: s + b]
                if len(batch) == b or not self.drop_last:
                    batches.append(batch.tolist())
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch, 1]).permutation(len(batches))
            batches = [batches[i] for i in order]
        yield from batches
