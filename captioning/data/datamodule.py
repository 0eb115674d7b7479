"""Lightning data module: records -> vocabulary -> datasets -> length-bucketed batches.

Training items are (image, caption) pairs; validation/test items are images with all their
references. Every batch is a `CaptionBatch` sorted by caption length, longest first (the soft
attention decoder of Xu et al. 2015 shrinks its active batch per time step).

Extension point for a feature cache: `_make_inputs(records, split)` returns a dataset mapping a
record index to the model input; by default it loads and transforms images (3, H, W), a cache can
return (L, D) feature tensors instead. `collate_captions` stacks either.
"""

from __future__ import annotations

import logging
import os
import time
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import BatchSampler, DataLoader, Dataset, RandomSampler, Sampler

from captioning.data.images import ImageLoadError, check_image, load_image
from captioning.data.readers import (
    DataError,
    ImageRecord,
    Problem,
    Records,
    read_coco_captions,
    read_karpathy,
)
from captioning.data.shapes import BOXES_FILE, SPLIT_FILE, generate_shapes, load_boxes
from captioning.data.transforms import IMAGENET_MEAN, IMAGENET_STD, build_image_transform
from captioning.vocab import Vocabulary, tokenize

log = logging.getLogger(__name__)

#: Images carved out for each missing COCO val/test split (at most a fifth of the source).
COCO_CARVE_SIZE = 5000
_CARVE_SEED = 0  # fixed, so that changing `seed` never changes the evaluation split
_STAGE_SPLITS: dict[str | None, tuple[str, ...]] = {
    "fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": (),
    None: ("train", "val", "test"),
}


# --------------------------------------------------------------------------------------------
# Batches


@dataclass
class CaptionBatch:
    """A batch sorted by `lengths`, longest first."""

    images: Tensor  # (B, 3, H, W) normalised images, or (B, L, D) cached features
    captions: Tensor  # (B, T) long: <start> w1 .. wn <end> <pad> ...
    lengths: Tensor  # (B,) long, tokens incl. <start> and <end>
    image_ids: list = field(default_factory=list)  # len B
    references: list[list[str]] = field(default_factory=list)  # raw references per item

    def __len__(self) -> int:
        return len(self.image_ids)

    def pin_memory(self) -> CaptionBatch:
        return CaptionBatch(self.images.pin_memory(), self.captions.pin_memory(),
                            self.lengths.pin_memory(), self.image_ids, self.references)


# An item: (input tensor, caption ids (T,), image id, raw references)
Item = tuple[Tensor, Tensor, Any, list[str]]


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
        images = torch.stack([it[0] for it in items])  # (B, 3, H, W) or (B, L, D)
        return CaptionBatch(images, captions, lengths, [it[2] for it in items],
                            [list(it[3]) for it in items])


collate_captions = CaptionCollate()


# --------------------------------------------------------------------------------------------
# Datasets


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
    """Record index -> cached annotation grid (L, D). The cache opens lazily per worker."""

    def __init__(self, cache: Any, paths: Sequence[str | os.PathLike[str]]) -> None:
        self.cache = cache
        self.paths = [str(p) for p in paths]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> Tensor:
        return self.cache[self.paths[index]]


class _EncodedCaptions:
    """Token ids of many captions in two flat arrays (compact, copy-on-write friendly)."""

    def __init__(self, ids: np.ndarray, offsets: np.ndarray) -> None:
        self.ids = ids  # (sum of lengths,) int32
        self.offsets = offsets  # (N + 1,) int64
        self.lengths = np.diff(offsets)  # (N,)

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> Tensor:
        return torch.from_numpy(self.ids[self.offsets[i]: self.offsets[i + 1]].astype(np.int64))


class _TokenIndex:
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

    def encode(self, vocab: Vocabulary, max_words: int) -> _EncodedCaptions:
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
        return _EncodedCaptions(ids, out_offsets)


class CaptionPairs(Dataset):
    """Training set: one item per (image, caption) pair."""

    def __init__(self, inputs: Dataset, records: Sequence[ImageRecord],
                 pair_record: np.ndarray, pair_caption: np.ndarray,
                 encoded: _EncodedCaptions) -> None:
        self.inputs = inputs
        self.image_ids = [r.image_id for r in records]
        self.captions = [r.captions for r in records]
        self.pair_record = pair_record
        self.pair_caption = pair_caption
        self.encoded = encoded

    @property
    def lengths(self) -> np.ndarray:
        """(N,) caption lengths incl. <start>/<end>, for the length-bucketing sampler."""
        return self.encoded.lengths

    def __len__(self) -> int:
        return len(self.pair_record)

    def __getitem__(self, index: int) -> Item:
        r = int(self.pair_record[index])
        raw = self.captions[r][int(self.pair_caption[index])]
        return self.inputs[r], self.encoded[index], self.image_ids[r], [raw]


class CaptionImages(Dataset):
    """Validation/test set: one item per image; the first reference is encoded (for the loss),
    every reference is returned raw (for the metrics)."""

    def __init__(self, inputs: Dataset, records: Sequence[ImageRecord],
                 encoded: _EncodedCaptions) -> None:
        self.inputs = inputs
        self.image_ids = [r.image_id for r in records]
        self.captions = [r.captions for r in records]
        self.encoded = encoded

    @property
    def lengths(self) -> np.ndarray:
        return self.encoded.lengths

    def __len__(self) -> int:
        return len(self.image_ids)

    def __getitem__(self, index: int) -> Item:
        return (self.inputs[index], self.encoded[index], self.image_ids[index],
                list(self.captions[index]))


# --------------------------------------------------------------------------------------------
# Samplers


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


# --------------------------------------------------------------------------------------------
# Data module


def _carve(records: list[ImageRecord], k: int) -> tuple[list[ImageRecord], list[ImageRecord]]:
    """Deterministically split off k records: (rest, carved). Independent of file order."""
    ordered = sorted(records, key=lambda r: str(r.image_id))
    perm = np.random.default_rng(_CARVE_SEED).permutation(len(ordered))
    chosen = set(perm[:k].tolist())
    rest = [r for i, r in enumerate(ordered) if i not in chosen]
    carved = [r for i, r in enumerate(ordered) if i in chosen]
    return rest, carved


class CaptionDataModule(L.LightningDataModule):
    """Images and captions for Show, Attend and Tell.

    Datasets:
      * "shapes": the synthetic shapes dataset under `root` (generated when missing, with the
        `shapes_*` parameters).
      * "karpathy": a Karpathy split file `split_file` (dataset_coco.json, dataset_flickr8k.json,
        dataset_flickr30k.json) with images under `image_root` (default: the file's folder).
      * "coco": raw COCO caption files `*_annotations` with images in `*_images`. Missing
        splits are carved out, `coco_carve_size` images each (at most a fifth of the source):
        test out of val when only `test_annotations` is missing, otherwise the missing val (and
        test) out of train. Carving sorts by image id and uses a fixed seed (not `seed`), so the
        evaluation split never changes between runs.

    The vocabulary is loaded from `vocab_path` when that file exists, else built from the
    training captions the readers accepted (`min_word_count`: None means 1 for shapes and 5
    otherwise; `max_vocab_size`) and saved there. It is available right after construction
    (`vocab`, `vocab_size`), before `setup`, and does not depend on the image-file checks.

    `max_caption_length` caps the words of a caption (training targets and the validation-loss
    reference; metrics see the full references). `hflip` flips training images at random;
    it is off by default because a flip swaps left and right, which makes spatial captions
    ("a red circle to the left of a blue square") false. `on_bad_data` applies to the annotation
    readers and to the image-file checks done by `setup` when `validate_images` (every referenced
    image is checked with `check_image` before the first step). What was skipped is counted in
    `skipped` ({"captions", "images", "image_files"}) and logged.
    """

    def __init__(
        self,
        *,
        dataset: Literal["shapes", "karpathy", "coco"] = "shapes",
        root: str = "data/shapes",
        split_file: str | None = None,
        image_root: str | None = None,
        train_annotations: str | None = None,
        val_annotations: str | None = None,
        test_annotations: str | None = None,
        train_images: str | None = None,
        val_images: str | None = None,
        test_images: str | None = None,
        coco_carve_size: int = COCO_CARVE_SIZE,
        boxes_path: str | None = None,
        shapes_num_train: int = 4000,
        shapes_num_val: int = 500,
        shapes_num_test: int = 500,
        shapes_image_size: int = 128,
        shapes_seed: int = 0,
        merge_restval: bool = True,
        vocab_path: str | None = None,
        min_word_count: int | None = None,
        max_vocab_size: int | None = None,
        max_caption_length: int = 50,
        image_size: int = 224,
        hflip: bool = False,
        batch_size: int = 32,
        eval_batch_size: int = 64,
        num_workers: int = 0,
        pin_memory: bool = False,
        persistent_workers: bool = False,
        length_bucketing: bool = True,
        seed: int = 0,
        on_bad_data: Literal["fail", "skip"] = "fail",
        validate_images: bool = True,
        feature_cache: bool = True,
        cache_dir: str | None = None,
    ) -> None:
        super().__init__()
        if dataset not in ("shapes", "karpathy", "coco"):
            raise ValueError(f"dataset must be 'shapes', 'karpathy' or 'coco', got {dataset!r}")
        if dataset == "karpathy" and not split_file:
            raise ValueError("dataset='karpathy' needs split_file")
        if dataset == "coco" and not (train_annotations and train_images):
            raise ValueError("dataset='coco' needs train_annotations and train_images")
        if on_bad_data not in ("fail", "skip"):
            raise ValueError(f"on_bad_data must be 'fail' or 'skip', got {on_bad_data!r}")
        for name, value in (("max_caption_length", max_caption_length),
                            ("image_size", image_size), ("batch_size", batch_size),
                            ("eval_batch_size", eval_batch_size)):
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        self.save_hyperparameters()
        self.dataset = dataset
        self.root = Path(root)
        self.split_file = split_file
        self.image_root = image_root
        self.coco_files = {"train": (train_annotations, train_images),
                           "val": (val_annotations, val_images),
                           "test": (test_annotations, test_images)}
        self.coco_carve_size = coco_carve_size
        self.boxes_path = boxes_path
        self.shapes_params = {"num_train": shapes_num_train, "num_val": shapes_num_val,
                              "num_test": shapes_num_test, "image_size": shapes_image_size,
                              "seed": shapes_seed}
        self.merge_restval = merge_restval
        self.vocab_path = vocab_path
        self.min_word_count = (1 if dataset == "shapes" else 5) if min_word_count is None \
            else min_word_count
        self.max_vocab_size = max_vocab_size
        self.max_caption_length = max_caption_length
        self.image_size = image_size
        self.hflip = hflip
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.persistent_workers = persistent_workers
        self.length_bucketing = length_bucketing
        self.seed = seed
        self.on_bad_data = on_bad_data
        self.validate_images = validate_images
        self.feature_cache = feature_cache
        self.cache_dir = cache_dir
        self._encoder: Any = None  # set by use_encoder_cache(); inputs become cached features
        self._encoder_config: dict[str, Any] = {}
        self._cache_device: Any = None

        self.skipped: dict[str, int] = {"captions": 0, "images": 0, "image_files": 0}
        self.problems: list[Problem] = []
        self._records: dict[str, list[ImageRecord]] | None = None
        self._vocab: Vocabulary | None = None
        self._boxes: dict[Any, list[dict[str, Any]]] | None = None
        self._boxes_loaded = False
        self._validated: set[str] = set()
        self._datasets: dict[str, Dataset] = {}
        self._token_cache: tuple[list[ImageRecord], _TokenIndex] | None = None
        if hflip:
            log.warning("hflip=True: flipped images make left/right in their captions false")

    # ---- records -------------------------------------------------------------------------

    def prepare_data(self) -> None:
        if self.dataset == "shapes":
            generate_shapes(self.root, **self.shapes_params)

    def _read_all(self) -> list[Records]:
        policy = self.on_bad_data
        if self.dataset == "shapes":
            generate_shapes(self.root, **self.shapes_params)
            return [read_karpathy(self.root / SPLIT_FILE, self.root,
                                  merge_restval=self.merge_restval, on_error=policy)]
        if self.dataset == "karpathy":
            split_file = Path(self.split_file)  # type: ignore[arg-type]
            image_root = self.image_root if self.image_root is not None else split_file.parent
            return [read_karpathy(split_file, image_root, merge_restval=self.merge_restval,
                                  on_error=policy)]
        out = []
        for split, (ann, images) in self.coco_files.items():
            if ann is None:
                continue
            if images is None:
                raise ValueError(f"{split}_annotations is set but {split}_images is not")
            out.append(read_coco_captions(ann, images, split=split, on_error=policy))
        return out

    def _load_records(self) -> dict[str, list[ImageRecord]]:
        if self._records is not None:
            return self._records
        t0 = time.perf_counter()
        parts = self._read_all()
        by_split: dict[str, list[ImageRecord]] = {"train": [], "val": [], "test": []}
        for part in parts:
            for r in part:
                by_split.setdefault(r.split, []).append(r)
            self.skipped["captions"] += part.skipped_captions
            self.skipped["images"] += part.skipped_images
            self.problems += part.problems
        if self.dataset == "coco":
            self._carve_coco(by_split)
        if self.problems:
            log.warning("skipped %d captions and %d image entries with bad annotations; "
                        "first problems:\n  %s", self.skipped["captions"], self.skipped["images"],
                        "\n  ".join(str(p) for p in self.problems[:5]))
        log.info("read %s records in %.1fs",
                 ", ".join(f"{len(v)} {k}" for k, v in by_split.items()),
                 time.perf_counter() - t0)
        self._records = by_split
        return by_split

    def _carve_coco(self, by_split: dict[str, list[ImageRecord]]) -> None:
        if self.coco_files["test"][0] is not None and self.coco_files["val"][0] is not None:
            return
        if self.coco_files["val"][0] is None:
            source = "train"
            missing = [s for s in ("val", "test") if self.coco_files[s][0] is None]
        else:
            source, missing = "val", ["test"]
        pool = by_split[source]
        k = min(self.coco_carve_size, len(pool) // 5)
        if k < 1:
            raise ValueError(f"cannot carve {missing} out of {len(pool)} {source} images")
        for split in missing:
            pool, carved = _carve(pool, k)
            by_split[split] = [ImageRecord(r.image_id, r.path, split, r.captions)
                               for r in carved]
            log.info("carved %d %s images out of %s", len(carved), split, source)
        by_split[source] = pool

    def records(self, split: str) -> list[ImageRecord]:
        """Records of a split ("train", "val", "test"; "restval" when not merged)."""
        return self._load_records().get(split, [])

    # ---- vocabulary ----------------------------------------------------------------------

    @property
    def vocab(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab = self._load_or_build_vocab()
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _load_or_build_vocab(self) -> Vocabulary:
        path = Path(self.vocab_path) if self.vocab_path else None
        if path is not None and path.exists():
            vocab = Vocabulary.load(path)
            log.info("loaded vocabulary of %d words from %s", len(vocab), path)
            return vocab
        train = self.records("train")
        if not train:
            raise ValueError("cannot build a vocabulary: the training split is empty")
        counts = self._train_tokens(train).counts()
        # Vocabulary.build counts tokens itself: feed each word `count` times.
        vocab = Vocabulary.build(([w] * n for w, n in counts.items()),
                                 min_count=self.min_word_count, max_size=self.max_vocab_size)
        log.info("built vocabulary of %d words (min_count=%d, max_size=%s)", len(vocab),
                 self.min_word_count, self.max_vocab_size)
        if path is not None:  # write atomically: DDP ranks may race here
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            vocab.save(tmp)
            os.replace(tmp, path)
        return vocab

    def state_dict(self) -> dict[str, Any]:
        return {"vocab": self.vocab.to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = Vocabulary.from_dict(state_dict["vocab"])
        if self._vocab is not None and saved != self._vocab:
            raise ValueError("the checkpoint's vocabulary differs from this data module's "
                             f"({len(saved)} vs {len(self._vocab)} words); pass vocab_path")
        self._vocab = saved

    # ---- boxes ---------------------------------------------------------------------------

    @property
    def boxes(self) -> dict[Any, list[dict[str, Any]]] | None:
        """{image_id: objects} from boxes.json (shapes, or `boxes_path`), else None."""
        if not self._boxes_loaded:
            path = Path(self.boxes_path) if self.boxes_path else (
                self.root / BOXES_FILE if self.dataset == "shapes" else None)
            if path is not None:
                if self.dataset == "shapes":
                    self._load_records()  # generates the dataset if needed
                self._boxes = load_boxes(path)
            self._boxes_loaded = True
        return self._boxes

    def crop_boxes(self, image_ids: Sequence[Any]) -> list[list[dict[str, Any]]] | None:
        """Boxes of `image_ids` in normalised [0, 1] xywh of the model input (eval transform)."""
        boxes = self.boxes
        if boxes is None:
            return None
        from captioning.metrics import boxes_to_crop_coords

        sizes = self._box_image_sizes()
        out = []
        for i in image_ids:
            w, h = sizes[i]
            out.append([{**o, "bbox": list(boxes_to_crop_coords(o["bbox"], w, h,
                                                                size=self.image_size))}
                        for o in boxes[i]])
        return out

    def _box_image_sizes(self) -> dict[Any, tuple[int, int]]:
        if not hasattr(self, "_box_sizes"):
            import json

            path = Path(self.boxes_path) if self.boxes_path else self.root / BOXES_FILE
            data = json.loads(path.read_text(encoding="utf-8"))
            self._box_sizes = {e["image_id"]: (int(e["width"]), int(e["height"]))
                               for e in data["images"]}
        return self._box_sizes

    # ---- setup ---------------------------------------------------------------------------

    def _check_images(self, split: str, *, raise_now: bool = True) -> list[Problem]:
        """Check every image of `split` with `check_image`; apply `on_bad_data`. With "fail",
        the problems are raised as a `DataError` (`raise_now`) or returned."""
        if split in self._validated or not self.validate_images:
            return []
        records = self._load_records()[split]
        t0 = time.perf_counter()

        def check(r: ImageRecord) -> str | None:
            try:
                check_image(r.path)
            except ImageLoadError as e:
                return e.reason
            return None

        workers = min(32, 4 * (os.cpu_count() or 1))
        with ThreadPoolExecutor(workers) as pool:
            reasons = list(pool.map(check, records, chunksize=256))
        bad = [Problem(str(r.path), f"{split} image {r.image_id!r}", "image", why)
               for r, why in zip(records, reasons) if why is not None]
        log.info("checked %d %s images in %.1fs (%d bad)", len(records), split,
                 time.perf_counter() - t0, len(bad))
        if bad:
            if self.on_bad_data == "fail":
                if raise_now:
                    raise DataError(bad)
                return bad
            log.warning("skipping %d %s images that cannot be read; first:\n  %s", len(bad),
                        split, "\n  ".join(str(p) for p in bad[:5]))
            self.skipped["image_files"] += len(bad)
            self.problems += bad
            self._records[split] = [r for r, why in zip(records, reasons)  # type: ignore[index]
                                    if why is None]
            self._datasets.pop(split, None)
        self._validated.add(split)
        return []

    def setup(self, stage: str | None = None) -> None:
        splits = _STAGE_SPLITS.get(stage, ("train", "val", "test"))
        bad = [p for split in splits for p in self._check_images(split, raise_now=False)]
        if bad:  # the bad images of every split of the stage, before any step runs
            raise DataError(bad)
        for split in splits:
            if split not in self._datasets:
                records = self.records(split)
                if not records:
                    why = f"the {split} split has no usable images"
                    if any(self.skipped.values()):
                        why += "; bad entries and image files were skipped, see the log"
                    raise DataError([Problem(self._source(split), f"{split} split", "split", why)])
                self._datasets[split] = self._make_dataset(records, split)

    def _source(self, split: str) -> str:
        """The annotation file a split comes from (for messages)."""
        if self.dataset == "shapes":
            return str(self.root / SPLIT_FILE)
        if self.dataset == "karpathy":
            return str(self.split_file)
        return str(self.coco_files[split][0] or self.coco_files["train"][0])

    def image_transform(self, train: bool) -> Callable[[Any], Tensor]:
        return build_image_transform(self.image_size, train=train, hflip=self.hflip)

    def _make_inputs(self, records: Sequence[ImageRecord], split: str) -> Dataset:
        """Record index -> model input: an image (3, H, W), or its cached annotations (L, D)."""
        if self._encoder is not None:
            return CachedInputs(self._build_cache(records, split), [r.path for r in records])
        return ImageInputs([r.path for r in records], self.image_transform(split == "train"),
                           min_side=self.image_size)

    # ---- feature cache -------------------------------------------------------------------

    def use_encoder_cache(self, encoder: Any, encoder_config: dict[str, Any], *,
                          device: Any = None) -> None:
        """Serve cached annotation grids of a frozen `encoder` instead of images.

        Each split's grids are computed once (`captioning.data.features.FeatureCache`) and
        memory-mapped; datasets already set up switch their inputs in place.
        """
        if self.hflip:
            log.warning("feature cache: hflip is ignored, cached features are never flipped")
        self._encoder, self._encoder_config, self._cache_device = encoder, encoder_config, device
        for split, ds in self._datasets.items():
            ds.inputs = self._make_inputs(self.records(split), split)  # type: ignore[attr-defined]

    def cache_features(self, splits: Sequence[str] = ("train", "val", "test")) -> dict[str, Any]:
        """Build (or find) the feature cache of each non-empty split; after `use_encoder_cache`.

        Images are checked first (`validate_images`, `on_bad_data`), as `setup` would.
        Returns {split: FeatureCache}.
        """
        if self._encoder is None:
            raise RuntimeError("call use_encoder_cache(encoder, key) before cache_features()")
        out: dict[str, Any] = {}
        for split in splits:
            if not self.records(split):
                continue
            self._check_images(split)
            out[split] = self._build_cache(self.records(split), split)
        return out

    def _cache_root(self) -> Path:
        if self.cache_dir:
            return Path(self.cache_dir)
        if self.dataset == "shapes":
            return self.root / "features"
        base = Path(self.split_file).parent if self.split_file else Path(
            self.coco_files["train"][0] or ".").parent
        return base / "features"

    def _build_cache(self, records: Sequence[ImageRecord], split: str) -> Any:
        from captioning.data.features import FeatureCache

        return FeatureCache.build(
            cache_dir=self._cache_root(), encoder=self._encoder,
            encoder_config=self._encoder_config, image_size=self.image_size,
            paths=[r.path for r in records], transform=self.image_transform(False),
            batch_size=self.eval_batch_size, num_workers=self.num_workers,
            device=self._cache_device)

    def _train_tokens(self, records: list[ImageRecord]) -> _TokenIndex:
        """Tokens of every caption of `records` (cached for the current training records)."""
        if self._token_cache is None or self._token_cache[0] is not records:
            self._token_cache = (records, _TokenIndex(c for r in records for c in r.captions))
        return self._token_cache[1]

    def _make_dataset(self, records: Sequence[ImageRecord], split: str) -> Dataset:
        inputs = self._make_inputs(records, split)
        max_words = self.max_caption_length
        if split != "train":
            first = _TokenIndex(r.captions[0] for r in records)
            return CaptionImages(inputs, records, first.encode(self.vocab, max_words))
        records = list(records) if not isinstance(records, list) else records
        tokens = self._train_tokens(records)
        truncated = int((tokens.lengths > max_words).sum())
        if truncated:
            log.info("truncated %d training captions to %d words", truncated, max_words)
        per_record = np.fromiter((len(r.captions) for r in records), dtype=np.int64,
                                 count=len(records))
        pair_record = np.repeat(np.arange(len(records), dtype=np.int32), per_record)
        firsts = np.repeat(np.cumsum(per_record) - per_record, per_record)
        pair_caption = (np.arange(len(pair_record)) - firsts).astype(np.int32)
        encoded = tokens.encode(self.vocab, max_words)
        self._token_cache = None  # no longer needed
        return CaptionPairs(inputs, records, pair_record, pair_caption, encoded)

    def dataset_for(self, split: str) -> Dataset:
        """The dataset of a split (set up on demand)."""
        if split not in self._datasets:
            self.setup({"train": "fit", "val": "validate", "test": "test"}[split])
        return self._datasets[split]

    # ---- loaders -------------------------------------------------------------------------

    def _loader_kwargs(self) -> dict[str, Any]:
        return {"collate_fn": CaptionCollate(self.vocab.pad_id), "num_workers": self.num_workers,
                "pin_memory": self.pin_memory,
                "persistent_workers": self.persistent_workers and self.num_workers > 0}

    def train_dataloader(self) -> DataLoader:
        ds = self.dataset_for("train")
        if self.length_bucketing:
            sampler = BucketBatchSampler(EpochShuffleSampler(len(ds), seed=self.seed),
                                         self.batch_size, False, lengths=ds.lengths,
                                         seed=self.seed)
            return DataLoader(ds, batch_sampler=sampler, **self._loader_kwargs())
        generator = torch.Generator().manual_seed(self.seed)
        return DataLoader(ds, batch_size=self.batch_size, shuffle=True, generator=generator,
                          **self._loader_kwargs())

    def _eval_loader(self, split: str) -> DataLoader:
        return DataLoader(self.dataset_for(split), batch_size=self.eval_batch_size,
                          shuffle=False, **self._loader_kwargs())

    def val_dataloader(self) -> DataLoader:
        return self._eval_loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._eval_loader("test")
