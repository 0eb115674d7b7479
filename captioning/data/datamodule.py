"""Lightning data module: a data source's records -> vocabulary -> datasets -> batches.

Where the records come from is the `source` (`captioning.data.sources`); the datasets and
batches are in `captioning.data.datasets`, the length-bucketing samplers in
`captioning.data.samplers`.

Extension point for a feature cache: `_make_inputs(records, split)` returns a dataset mapping a
record index to the model input; by default it loads and transforms images (3, H, W), a cache can
return (L, D) feature tensors instead (`use_encoder_cache`), or rows of the split's grids held
on the device (`features_on_device`: `hold_grids`, gathered in `on_after_batch_transfer`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import lightning.pytorch as L
import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from captioning.choices import check_choice
from captioning.data.datasets import (
    CachedInputs,
    CaptionCollate,
    CaptionDataset,
    CaptionImages,
    CaptionPairs,
    ImageInputs,
    TokenIndex,
)
from captioning.data.device_grids import DeviceGrids
from captioning.data.features import CacheVerify
from captioning.data.images import image_problems
from captioning.data.problems import DataError, Problem
from captioning.data.readers import DATA_SPLITS, ImageRecord, OnError
from captioning.data.reading import bad_images, read_source
from captioning.data.samplers import (
    BucketBatchSampler,
    EpochShuffleSampler,
    ImageBatchSampler,
    ResumableDataLoader,
)
from captioning.data.serving import SPLIT_STAGE, STAGE_SPLITS, FeatureServing
from captioning.data.sources import DataSource, ObjectBoxes, ShapesSource
from captioning.data.transforms import build_image_transform
from captioning.data.vocab_file import check_origin, load_or_build_vocab
from captioning.vocab import Vocabulary

if TYPE_CHECKING:
    pass

log = logging.getLogger(__name__)



def _check_arguments(source: DataSource | None, on_bad_data: str, **sizes: int) -> None:
    """Validate `CaptionDataModule`'s source, bad-data policy and sizes (each >= 1)."""
    if source is not None and not isinstance(source, DataSource):
        raise TypeError(f"source must be a DataSource, got {type(source).__name__}")
    check_choice("on_bad_data", on_bad_data, OnError)
    for name, value in sizes.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


class CaptionDataModule(FeatureServing, L.LightningDataModule):
    """Images and captions for Show, Attend and Tell.

    `source` says where they come from (`captioning.data.sources`): `ShapesSource` (the
    default, with its defaults: the synthetic shapes dataset under data/shapes),
    `KarpathySplits` or `CocoCaptions`.

    The vocabulary is loaded from `vocab_path` when that file exists, else built from the
    training captions the readers accepted (`min_word_count`: None means the source's
    `default_min_word_count`, 1 for shapes and 5 otherwise; `max_vocab_size`) and saved there.
    A file built so records its settings and captions; `setup("fit")` with others stops
    (DataError). Evaluation takes the file as it is (a checkpoint holds its own vocabulary).
    It is available right after construction (`vocab`, `vocab_size`), before `setup`, and does
    not depend on the image-file checks.

    `max_caption_length` caps the words of a caption (training targets and the validation-loss
    reference; metrics see the full references). `eval_references`: val and test score against
    each image's first N references (the authors' reference files hold 5); None: all of them. `hflip` flips training images at random;
    it is off by default because a flip swaps left and right, which makes spatial captions
    ("a red circle to the left of a blue square") false. `on_bad_data` applies to the annotation
    readers and to the image-file checks done by `setup` when `validate_images` (every referenced
    image is checked with `check_image` before the first step). What was skipped is counted in
    `skipped` ({"captions", "images", "image_files"}) and logged.
    Training batches are length-bucketed (`length_bucketing`), or with `group_by_image` hold
    each image's captions together, so that a frozen encoder and the key projection run once
    per image (`ImageBatchSampler`; its speed-up is in docs/benchmarks.md).
    `cache_verify`: how much of a feature cache is checked when opened (see `features`): every
    block's hash (`full`), each block on its first read (`lazy`), or sizes only (`size`).
    `features_on_device`: where the feature cache serves (a frozen encoder), each split's grids
    are held whole on the training device (a GPU's memory; on the CPU, the cache's map itself)
    and batches carry their rows, gathered there after the transfer (`on_after_batch_transfer`):
    no grid goes through the loader or the host-to-device copy. A split that does not fit on
    the GPU stops the run with one line (`device_grids.room_problem`).
    """

    def __init__(
        self,
        *,
        source: DataSource | None = None,
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
        group_by_image: bool = False,
        seed: int = 0,
        on_bad_data: OnError = "fail",
        validate_images: bool = True,
        feature_cache: bool = True,
        cache_dir: str | None = None,
        cache_verify: CacheVerify = "full",
        eval_references: int | None = None,
        features_on_device: bool = False,
    ) -> None:
        super().__init__()
        _check_arguments(source, on_bad_data, max_caption_length=max_caption_length,
                         image_size=image_size, batch_size=batch_size,
                         eval_batch_size=eval_batch_size,
                         eval_references=1 if eval_references is None else eval_references)
        self.source: DataSource = source if source is not None else ShapesSource()
        # The source is saved as plain data (its class path and arguments): a pickled object in
        # a checkpoint would not load with torch.load(weights_only=True).
        self.save_hyperparameters(ignore=["source"])
        self.save_hyperparameters({"source": self.source.config()})  # added to the others
        self.vocab_path = vocab_path
        self.min_word_count = self.source.default_min_word_count if min_word_count is None \
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
        self.group_by_image = group_by_image
        self.seed = seed
        self.on_bad_data = on_bad_data
        self.validate_images = validate_images
        check_choice("cache_verify", cache_verify, CacheVerify)
        self.feature_cache, self.cache_dir, self.cache_verify = feature_cache, cache_dir, \
            cache_verify
        self.features_on_device, self.eval_references = features_on_device, eval_references
        self._init_state()
        if hflip:
            log.warning("hflip=True: flipped images make left/right in their captions false")

    def _init_state(self) -> None:
        """The state filled in later: the encoder of the feature cache, what reading and
        checking skipped, and the records, vocabulary, grounding and datasets, built lazily."""
        self._encoder: Any = None  # set by use_encoder_cache(); inputs become cached features
        self._encoder_config: dict[str, Any] = {}
        self._cache_device: Any = None
        self.device_grids = DeviceGrids()  # with `features_on_device`
        self.opened_caches: set[str] = set()  # the caches' array files, as opened or built
        self._checked_caches: frozenset[str] = frozenset()  # checked by another process

        self.skipped: dict[str, int] = {"captions": 0, "images": 0, "image_files": 0}
        self.carved: tuple[str, ...] = ()  # the splits carved out of the training images
        self.problems: list[Problem] = []
        self._records: dict[str, list[ImageRecord]] | None = None
        self._vocab: Vocabulary | None = None
        self._vocab_origin: dict[str, Any] | None = None  # a shared file's, until checked
        self._grounding: ObjectBoxes | None = None
        self._grounding_loaded = False
        self._validated: set[str] = set()
        self._datasets: dict[str, CaptionDataset] = {}
        self._token_cache: tuple[list[ImageRecord], TokenIndex] | None = None

    # ---- records -------------------------------------------------------------------------

    def prepare_data(self) -> None:
        self.source.prepare()

    def _load_records(self) -> dict[str, list[ImageRecord]]:
        if self._records is not None:
            return self._records
        t0 = time.perf_counter()
        read = read_source(self.source, self.on_bad_data, validate_images=self.validate_images)
        by_split = read.splits
        self.carved = read.carved
        self.skipped["captions"] += read.skipped_captions
        self.skipped["images"] += read.skipped_images
        self.problems += read.problems
        if self.problems:
            log.warning("skipped %d captions and %d image entries with bad annotations; "
                        "first problems:\n  %s", self.skipped["captions"], self.skipped["images"],
                        "\n  ".join(str(p) for p in self.problems[:5]))
        log.info("read %s records in %.1fs",
                 ", ".join(f"{len(v)} {k}" for k, v in by_split.items()),
                 time.perf_counter() - t0)
        self._records = by_split
        return by_split

    def records(self, split: str) -> list[ImageRecord]:
        """Records of a split ("train", "val", "test"; "restval" when not merged)."""
        return self._load_records().get(split, [])

    @property
    def checked(self) -> bool:
        """Whether `problems` holds this run's: the records read and, with `validate_images`,
        the images of a stage's splits checked (`setup`)."""
        return self._records is not None and (not self.validate_images or bool(self._validated))

    # ---- vocabulary ----------------------------------------------------------------------

    @property
    def vocab(self) -> Vocabulary:
        if self._vocab is None:
            self._vocab, self._vocab_origin = load_or_build_vocab(self.vocab_path or None,
                                                                  self._build_vocab)
        return self._vocab

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def _build_vocab(self) -> Vocabulary:
        train = self.records("train")
        if not train:
            raise DataError([Problem(self.source.describe("train"), "train split", "split",
                                     "is empty: no vocabulary can be built from it")],
                            skipped=self.problems)
        counts = self._train_tokens(train).counts()
        # Vocabulary.build counts tokens itself: feed each word `count` times.
        return Vocabulary.build(([w] * n for w, n in counts.items()),
                                min_count=self.min_word_count, max_size=self.max_vocab_size)

    def state_dict(self) -> dict[str, Any]:
        return {"vocab": self.vocab.to_dict()}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        saved = Vocabulary.from_dict(state_dict["vocab"])
        if self._vocab is not None and saved != self._vocab:
            raise ValueError("the checkpoint's vocabulary differs from this data module's "
                             f"({len(saved)} vs {len(self._vocab)} words); pass vocab_path")
        self._vocab = saved

    # ---- grounding ---------------------------------------------------------------------

    @property
    def grounding(self) -> ObjectBoxes | None:
        """The source's object boxes (shapes' boxes.json, or a source's `boxes_path`), else
        None; loaded once."""
        if not self._grounding_loaded:
            self._grounding = self.source.grounding()
            self._grounding_loaded = True
        return self._grounding

    @property
    def boxes(self) -> dict[Any, list[dict[str, Any]]] | None:
        """{image_id: objects} of `grounding`, or None."""
        grounding = self.grounding
        return None if grounding is None else grounding.table

    # ---- setup ---------------------------------------------------------------------------

    def _check_images(self, split: str, *, raise_now: bool = True) -> list[Problem]:
        """Check every image of `split` with `check_image`; apply `on_bad_data`. With "fail",
        the problems are raised as a `DataError` (`raise_now`) or returned."""
        if split in self._validated or not self.validate_images:
            return []
        records = self._load_records()[split]
        t0 = time.perf_counter()
        reasons = image_problems([r.path for r in records])
        bad = bad_images(records, reasons, split, self.source.config()["init_args"])
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
        _ = self.vocab
        if stage in ("fit", None) and self._vocab_origin and self.vocab_path:
            # training with a shared vocabulary file: built from these captions and settings?
            check_origin(self.vocab_path, self._vocab_origin, self.vocab, self._build_vocab())
            self._vocab_origin = None
        self._setup_splits(STAGE_SPLITS.get(stage, DATA_SPLITS))

    def _setup_splits(self, splits: Sequence[str]) -> None:
        """The datasets of `splits`, after their images are checked (see `setup`)."""
        bad = [p for split in splits for p in self._check_images(split, raise_now=False)]
        if bad:  # the bad images of every split of the stage, before any step runs
            raise DataError(bad)
        self.grounding  # noqa: B018 -- loads and checks the boxes file before any step runs
        for split in splits:
            if split not in self._datasets:
                records = self.records(split)
                if not records:
                    why = f"the {split} split has no usable images"
                    if any(self.skipped.values()):
                        why += "; bad entries and image files were skipped, see the log"
                    raise DataError([Problem(self.source.describe(split), f"{split} split",
                                             "split", why)], skipped=self.problems)
                self._datasets[split] = self._make_dataset(records, split)

    def image_transform(self, train: bool) -> Callable[[Any], Tensor]:
        return build_image_transform(self.image_size, train=train, hflip=self.hflip)

    def _make_inputs(self, records: Sequence[ImageRecord], split: str) -> Dataset:
        """Record index -> model input: an image (3, H, W), its cached annotations (L, D), or
        with `features_on_device` its row of the split's grids (`GridRows`)."""
        if self._encoder is not None:
            cache, paths = self._build_cache(records, split), [r.path for r in records]
            return self.device_grids.serve(split, cache, paths) if self.features_on_device \
                else CachedInputs(cache, paths)
        return ImageInputs([r.path for r in records], self.image_transform(split == "train"),
                           min_side=self.image_size)

    def _train_tokens(self, records: list[ImageRecord]) -> TokenIndex:
        """Tokens of every caption of `records` (cached for the current training records)."""
        if self._token_cache is None or self._token_cache[0] is not records:
            self._token_cache = (records, TokenIndex(c for r in records for c in r.captions))
        return self._token_cache[1]

    def _make_dataset(self, records: Sequence[ImageRecord], split: str) -> CaptionDataset:
        inputs = self._make_inputs(records, split)
        max_words = self.max_caption_length
        if split != "train":
            first = TokenIndex(r.captions[0] for r in records)
            return CaptionImages(inputs, records, first.encode(self.vocab, max_words),
                                 references=self.eval_references)
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

    def dataset_for(self, split: str) -> CaptionDataset:
        """The dataset of a split (set up on demand)."""
        if split not in self._datasets:  # as its stage would, less the vocabulary's check:
            stage = SPLIT_STAGE[split]
            self._setup_splits(STAGE_SPLITS[stage])  # caches and benchmarks do not train
        return self._datasets[split]

    # ---- loaders -------------------------------------------------------------------------

    def _loader_kwargs(self) -> dict[str, Any]:
        return {"collate_fn": CaptionCollate(self.vocab.pad_id), "num_workers": self.num_workers,
                "pin_memory": self.pin_memory,
                "persistent_workers": self.persistent_workers and self.num_workers > 0}

    def train_dataloader(self) -> DataLoader:
        ds = self.dataset_for("train")
        inner = EpochShuffleSampler(len(ds), seed=self.seed)
        if self.group_by_image or self.length_bucketing:
            # resumable: a mid-epoch checkpoint continues its epoch (see ResumableDataLoader)
            sampler = ImageBatchSampler(inner, self.batch_size, images=ds.pair_record,
                                        lengths=ds.lengths, seed=self.seed) \
                if self.group_by_image else \
                BucketBatchSampler(inner, self.batch_size, lengths=ds.lengths, seed=self.seed)
            return ResumableDataLoader(ds, batch_sampler=sampler, **self._loader_kwargs())
        # not resumable within an epoch: Lightning warns and starts that epoch's data afresh
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
