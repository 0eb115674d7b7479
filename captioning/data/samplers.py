"""Training samplers: a (seed, epoch)-determined shuffle, length-bucketed batches, and a
DataLoader that resumes within an epoch."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler, Sampler


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
    exactly one batch. `start` skips the first batches of the next pass (then returns to 0):
    `ResumableDataLoader` sets it to continue an epoch. The epoch is taken from `sampler.epoch` when it has one (Lightning calls
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
        self.start = 0  # batches of the next pass to skip (resuming within an epoch)
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
        pool = self.batch_size * self.bucket_size_multiplier
        batches: list[list[int]] = []
        for start in range(0, len(idx), pool):
            chunk = idx[start: start + pool]
            batches += self._cut(chunk[np.argsort(-self.lengths[chunk], kind="stable")])
        yield from self._hand_out(batches)

    def _cut(self, indices: np.ndarray) -> list[list[int]]:
        """`indices` cut in order into batches of `batch_size`; a shorter last one is kept
        unless `drop_last`."""
        b = self.batch_size
        batches = [indices[s: s + b].tolist() for s in range(0, len(indices), b)]
        return batches[:-1] if batches and self.drop_last and len(batches[-1]) < b else batches

    def _hand_out(self, batches: list[list[int]]) -> Iterator[list[int]]:
        """The pass's batches in a (seed, epoch)-shuffled order, from `start` on."""
        if self.shuffle:
            order = np.random.default_rng([self.seed, self.epoch, 1]).permutation(len(batches))
            batches = [batches[i] for i in order]
        start, self.start = self.start, 0
        yield from batches[start:]


class ImageBatchSampler(BucketBatchSampler):
    """Batches that hold the captions of each image together: the images in a (seed, epoch)-
    determined order, each image's pairs in a row, cut into batches of `batch_size` (an
    image's captions are split only at a batch's edge). A frozen encoder and the scorer's key
    projection then run once per image of a batch (`captioning.models.repeats`). With
    `lengths`, the images of each pool of `batch_size * bucket_size_multiplier` pairs are
    ordered by their longest caption first, since a batch runs as many word steps as its
    longest caption; the batches are then shuffled.

    `images` (N,): the image of each pair. Every pair lands in exactly one batch of the epoch.
    Under Lightning DDP the `sampler` argument is a `DistributedSampler`; only its rank,
    `num_replicas`, length and epoch are read. Each rank takes its own contiguous share of the
    one order (padded by repeating its start, as a DistributedSampler pads), so the ranks
    hand out the same number of batches. `start` resumes within an epoch as in the parent.
    """

    def __init__(self, sampler: Sampler[int] | Sequence[int], batch_size: int,
                 drop_last: bool = False, *, images: Sequence[int] | np.ndarray,
                 lengths: Sequence[int] | np.ndarray | None = None, seed: int = 0,
                 bucket_size_multiplier: int = 100) -> None:
        super().__init__(sampler, batch_size, drop_last, seed=seed, shuffle=True,
                         lengths=np.zeros(len(images)) if lengths is None else lengths,
                         bucket_size_multiplier=bucket_size_multiplier)
        images = np.asarray(images, dtype=np.int64)
        # Each image's pairs and its longest caption, found once (not every epoch).
        order = np.argsort(images, kind="stable")
        starts = np.flatnonzero(np.r_[True, images[order][1:] != images[order][:-1]])
        self.groups = np.split(order, starts[1:]) if len(order) else []
        self.longest = np.maximum.reduceat(self.lengths[order], starts) if len(order) else order
        self.sizes = np.diff(np.r_[starts, len(order)])

    def __len__(self) -> int:
        full, rest = divmod(len(self.sampler), self.batch_size)
        return full + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[list[int]]:
        perm = np.random.default_rng([self.seed, self.epoch, 2]).permutation(len(self.groups))
        pool = np.cumsum(self.sizes[perm]) // (self.batch_size * self.bucket_size_multiplier)
        # Within a pool, images by their longest caption: a batch runs as long as its longest.
        perm = perm[np.lexsort((-self.longest[perm], pool))]
        pairs = np.concatenate([self.groups[i] for i in perm]) if len(perm) else perm
        share = len(self.sampler)  # pairs per rank
        rank = int(getattr(self.sampler, "rank", 0))
        total = share * int(getattr(self.sampler, "num_replicas", 1))
        pairs = np.resize(pairs, max(total, len(pairs)))[rank * share: (rank + 1) * share]
        yield from self._hand_out(self._cut(pairs))  # shuffled: not the pools' long-to-short order


class ResumableDataLoader(DataLoader):
    """A DataLoader over a `BucketBatchSampler` whose place within an epoch is saved in
    Lightning checkpoints and restored on resume (Lightning's stateful-loader interface,
    `state_dict` / `load_state_dict`), so that a mid-epoch checkpoint continues its epoch:
    no batch is repeated or skipped.

    The state is (epoch, batches handed out to the training loop in it), counted as the loop
    receives them, not as the workers prefetch them. Resuming sets the sampler's epoch and
    skips that many batches by index (no data is loaded for them); the order is (seed,
    epoch)-determined, so the rest of the epoch is the interrupted run's. The iterator made
    for the rest of the epoch leaves the global RNG as the checkpoint restored it, so dropout
    continues where it stopped. With workers, their iterator starts at the first batch, after
    Lightning has set the epoch (Lightning makes the first iterator before). Under DDP every
    rank hands out the same number of batches, so rank 0's state, the one in the checkpoint,
    fits every rank's shard.
    """

    _epoch = -1  # the epoch of the pass under way
    _done = 0  # batches of that epoch handed out (or to skip, while a resume is pending)
    _resume = False

    def state_dict(self) -> dict[str, int]:
        epoch = self._sampler_epoch()
        return {"epoch": epoch, "batches": self._done if epoch == self._epoch else 0}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._epoch, self._done, self._resume = int(state["epoch"]), int(state["batches"]), True
        if callable(getattr(self.batch_sampler, "set_epoch", None)):
            self.batch_sampler.set_epoch(self._epoch)

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        resume = self._resume and self._done < len(self)  # not a pass that had ended
        # Without workers the iterator is made now, as a plain DataLoader's is (the same draw
        # from the RNG at the same point); the sampler itself starts at the first batch.
        inner = None if self.num_workers > 0 else self._start(resume)
        return self._pass(inner, resume)

    def _sampler_epoch(self) -> int:
        return int(getattr(self.batch_sampler, "epoch", 0))

    def _start(self, resume: bool) -> Iterator[Any]:
        if not resume:
            return super().__iter__()
        with torch.random.fork_rng(devices=[]):  # training goes on with the checkpoint's RNG
            return super().__iter__()

    def _pass(self, inner: Iterator[Any] | None, resume: bool) -> Iterator[Any]:
        """One pass (the rest of the epoch, when resuming), counting the batches handed out."""
        epoch, skips = self._sampler_epoch(), hasattr(self.batch_sampler, "start")
        start = self._done if resume and skips and epoch == self._epoch else 0
        self._epoch, self._done, self._resume = epoch, start, False
        if skips:
            self.batch_sampler.start = start
        for batch in inner if inner is not None else self._start(resume):
            self._done += 1
            yield batch
