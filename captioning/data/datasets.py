"""Datasets and batches: record index -> model input, captions as token ids, collation.

Training items are (image, caption) pairs (`CaptionPairs`); validation/test items are images
with all their references (`CaptionImages`). Every batch is a `CaptionBatch` sorted by caption
length, longest first (the soft attention decoder of Xu et al. 2015 shrinks its active batch
per time step).

The model input of a record comes from an inputs dataset: `ImageInputs` loads and transforms
images (3, H, W), `CachedInputs` serves cached feature grids (L, D), `GridRows` the rows of
grids held on the device; `CaptionCollate` stacks either, or lists the rows.
"""

from __future__ import annotations

import os
from array import array
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from captioning.data.images import load_image
from captioning.data.readers import ImageRecord
from captioning.vocab import Vocabulary, tokenize

# --------------------------------------------------------------------------------------------
# Batches


class CaptionBatch:
    """A batch sorted by `lengths`, longest first.

    A plain class, not a dataclass, on purpose: Lightning walks a dataclass field by field, into
    every reference string, to move it to the device (about 1 ms a batch of 64 pairs on this
    project's CPU), and again before that to cast it under the "-true" precisions (on the host).
    A `CaptionBatch` moves itself instead (`to`: its tensors, without blocking on CUDA),
    and those casts pass it over: `CaptionDataModule.on_after_batch_transfer` casts `images`
    after the transfer, to the values Lightning's cast gives."""

    __slots__ = ("captions", "grid_split", "image_ids", "images", "lengths", "references")

    def __init__(self, images: Tensor, captions: Tensor, lengths: Tensor,
                 image_ids: list | None = None, references: list[list[str]] | None = None,
                 grid_split: str | None = None) -> None:
        self.images = images  # (B, 3, H, W) normalised images, or (B, L, D) cached features
        self.captions = captions  # (B, T) long: <start> w1 .. wn <end> <pad> ...
        self.lengths = lengths  # (B,) long, tokens incl. <start> and <end>
        self.image_ids: list = [] if image_ids is None else image_ids  # len B
        # raw references per item
        self.references: list[list[str]] = [] if references is None else references
        # Set by `GridRows`: `images` is (B,) long, the rows of this split's grids on the
        # device, which `CaptionDataModule.on_after_batch_transfer` gathers into (B, L, D).
        self.grid_split = grid_split

    def __len__(self) -> int:
        return len(self.image_ids)

    def __repr__(self) -> str:
        return (f"CaptionBatch(images={tuple(self.images.shape)} {self.images.dtype}, "
                f"captions={tuple(self.captions.shape)}, {len(self)} items, "
                f"grid_split={self.grid_split!r})")

    def replace(self, **changes: Any) -> CaptionBatch:
        """A copy with `changes` (field names) applied."""
        fields = {name: getattr(self, name) for name in self.__slots__}
        unknown = set(changes) - set(fields)
        if unknown:
            raise TypeError(f"CaptionBatch has no field(s) {sorted(unknown)}")
        return CaptionBatch(**{**fields, **changes})

    def to(self, device: torch.device | str, *, non_blocking: bool | None = None
           ) -> CaptionBatch:
        """The batch with its tensors on `device` (Lightning's transfer calls this, with the
        device only). `non_blocking` None: not blocking except to the CPU (and MPS), as
        Lightning copies a tensor."""
        device = torch.device(device)  # a dtype is refused here: the captions stay long
        if non_blocking is None:
            non_blocking = device.type not in ("cpu", "mps")
        return self.replace(**{name: getattr(self, name).to(device, non_blocking=non_blocking)
                               for name in ("images", "captions", "lengths")})

    def pin_memory(self) -> CaptionBatch:
        return self.replace(images=self.images.pin_memory(),
                            captions=self.captions.pin_memory(),
                            lengths=self.lengths.pin_memory())


@dataclass(frozen=True)
class GridRow:
    """An item's input under `GridRows`: a row of `split`'s grids held on the device."""

    split: str
    row: int


# An item: (input tensor or GridRow, caption ids (T,), image id, raw references)
Item = tuple["Tensor | GridRow", Tensor, Any, list[str]]


class CaptionCollate:
    """Stack inputs, pad captions with `pad_id` and sort the batch by length, longest first."""

    def __init__(self, pad_id: int = Vocabulary.pad_id) -> None:
        self.pad_id = pad_id

    def __call__(self, items: Sequence[Item]) -> CaptionBatch:
        items = sorted(items, key=lambda it: -len(it[1]))  # stable: ties keep sampler order
        lengths = torch.tensor([len(it[1]) for it in items], dtype=torch.long)  # (B,)
        captions = torch.full((len(items), int(lengths.max())), self.pad_id, dtype=torch.long)
        for i, it in enumerate(items):
            captions[i, : len(it[1])] = it[1]
        ids, refs = [it[2] for it in items], [list(it[3]) for it in items]
        if isinstance(items[0][0], GridRow):  # rows of grids gathered on the device
            rows = torch.tensor([it[0].row for it in items], dtype=torch.long)  # (B,)
            return CaptionBatch(rows, captions, lengths, ids, refs, items[0][0].split)
        images = torch.stack([it[0] for it in items])  # (B, 3, H, W) or (B, L, D)
        return CaptionBatch(images, captions, lengths, ids, refs)


# --------------------------------------------------------------------------------------------
# Model inputs


class ImageInputs(Dataset):
    """Record index -> transformed image tensor (3, H, W). Holds only paths (picklable)."""

    def __init__(self, paths: Sequence[str | os.PathLike[str]],
                 transform: Callable[[Any], Tensor], *, min_side: int | None = None) -> None:
        self.paths = [str(p) for p in paths]
        self.transform = transform
        self.min_side = min_side

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor:
        return self.transform(load_image(self.paths[index], min_side=self.min_side))


class CachedInputs(Dataset):
    """Record index -> cached annotation grid (L, D), a view of the cache's read-only map that
    the batch's stack copies (`FeatureCache.view`). The cache opens lazily per worker."""

    def __init__(self, cache: Any, paths: Sequence[str | os.PathLike[str]]) -> None:
        self.cache = cache
        self.paths = [str(p) for p in paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor:
        return self.cache.view(self.paths[index])


class GridRows(Dataset):
    """Record index -> `GridRow(split, row)`: the record's row of the split's grids, which the
    data module holds whole on the training device (`features_on_device`); no grid goes
    through the loader."""

    def __init__(self, split: str, rows: np.ndarray) -> None:
        self.split = split
        self.rows = rows  # (N,) int64 the cache row of each record

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> GridRow:
        return GridRow(self.split, int(self.rows[index]))


# --------------------------------------------------------------------------------------------
# Captions


class EncodedCaptions:
    """Token ids of many captions in two flat arrays (compact, copy-on-write friendly)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        self.ids = ids  # (sum of lengths,) int32
        self.offsets = offsets  # (N + 1,) int64
        self.lengths = np.diff(offsets)  # (N,)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Tensor:
        return torch.from_numpy(self.ids[self.offsets[i]: self.offsets[i + 1]].astype(np.int64))


class TokenIndex:
    """Captions tokenised once (the costly step at COCO scale), stored as word indices.

    `words` lists every distinct token; caption i is `words[flat[offsets[i]:offsets[i+1]]]`.
    It yields both the word counts for the vocabulary and, given a vocabulary, the encoded
    captions, so that training captions are tokenised only once.
    """

    def __init__(self, captions: Iterable[str]) -> None:
        index: dict[str, int] = {}
        flat = array("i")
        lengths = array("q")
        for caption in captions:
            tokens = tokenize(caption)
            flat.extend([index.setdefault(t, len(index)) for t in tokens])
            lengths.append(len(tokens))
        self.words = list(index)
        self.flat = np.frombuffer(flat, dtype=np.int32) if flat else np.zeros(0, np.int32)
        self.lengths = np.frombuffer(lengths, dtype=np.int64) if lengths else \
            np.zeros(0, np.int64)
        self.offsets = np.zeros(len(self.lengths) + 1, dtype=np.int64)
        np.cumsum(self.lengths, out=self.offsets[1:])

    def counts(self) -> dict[str, int]:
        c = np.bincount(self.flat, minlength=len(self.words))
        return {w: int(n) for w, n in zip(self.words, c)}

    def encode(self, vocab: Vocabulary, max_words: int) -> EncodedCaptions:
        """<start> w1 .. wk <end> per caption, k = min(length, max_words)."""
        n = len(self.lengths)
        lut = np.array([vocab.stoi.get(w, vocab.unk_id) for w in self.words], dtype=np.int32)
        body = np.minimum(self.lengths, max_words)  # (N,)
        out_offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(body + 2, out=out_offsets[1:])
        ids = np.empty(int(out_offsets[-1]), dtype=np.int32)
        ids[out_offsets[:-1]] = vocab.start_id
        ids[out_offsets[1:] - 1] = vocab.end_id
        caption = np.repeat(np.arange(n), body)  # caption of each kept token
        body_starts = np.zeros(n, dtype=np.int64)
        np.cumsum(body[:-1], out=body_starts[1:])
        pos = np.arange(int(body.sum())) - body_starts[caption]  # position within caption
        ids[out_offsets[:-1][caption] + 1 + pos] = lut[self.flat[self.offsets[:-1][caption] + pos]]
        return EncodedCaptions(ids, out_offsets)


# --------------------------------------------------------------------------------------------
# Datasets


class CaptionDataset(Dataset):
    """Common part of the caption datasets: the model `inputs` of the records (replaceable in
    place, e.g. by a feature cache), their ids and raw captions, and encoded captions."""

    def __init__(self, inputs: Dataset, records: Sequence[ImageRecord],
                 encoded: EncodedCaptions) -> None:
        self.inputs = inputs
        self.image_ids = [r.image_id for r in records]
        self.captions = [r.captions for r in records]
        self.encoded = encoded

    @property
    def lengths(self) -> np.ndarray:
        """(N,) caption lengths incl. <start>/<end>, for the length-bucketing sampler."""
        return self.encoded.lengths


class CaptionPairs(CaptionDataset):
    """Training set: one item per (image, caption) pair."""

    def __init__(self, inputs: Dataset, records: Sequence[ImageRecord],
                 pair_record: np.ndarray, pair_caption: np.ndarray,
                 encoded: EncodedCaptions) -> None:
        super().__init__(inputs, records, encoded)
        self.pair_record = pair_record
        self.pair_caption = pair_caption

    def __len__(self) -> int:
        return len(self.pair_record)

    def __getitem__(self, index: int) -> Item:
        r = int(self.pair_record[index])
        raw = self.captions[r][int(self.pair_caption[index])]
        return self.inputs[r], self.encoded[index], self.image_ids[r], [raw]


class CaptionImages(CaptionDataset):
    """Validation/test set: one item per image; the first reference is encoded (for the loss),
    every reference, or the first `references`, is returned raw (for the metrics)."""

    def __init__(self, inputs: Dataset, records: Sequence[ImageRecord],
                 encoded: EncodedCaptions, *, references: int | None = None) -> None:
        super().__init__(inputs, records, encoded)
        self.references = references

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> Item:
        return (self.inputs[index], self.encoded[index], self.image_ids[index],
                list(self.captions[index][: self.references]))
