"""The data module's feature cache: a frozen encoder's annotation grids served instead of
images (`use_encoder_cache`, built once per split: `captioning.data.features`), and with
`features_on_device` held on the training device (`captioning.data.device_grids`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from captioning.data.datasets import CaptionBatch
from captioning.data.device_grids import DeviceGrids
from captioning.data.features import FeatureCache
from captioning.data.images import ImageLoadError
from captioning.data.problems import DataError
from captioning.data.readers import DATA_SPLITS, ImageRecord
from captioning.data.reading import unchecked_image
from captioning.distributed import agreement, rank_zero_result

log = logging.getLogger(__name__)

#: The splits each stage sets up, and the stage that sets each split up.
STAGE_SPLITS: dict[str | None, tuple[str, ...]] = {
    "fit": ("train", "val"), "validate": ("val",), "test": ("test",), "predict": (),
    None: DATA_SPLITS,
}
SPLIT_STAGE = {"train": "fit", "val": "validate", "test": "test"}


class FeatureServing:
    """`CaptionDataModule`'s feature-cache methods (a base class of it). The data module
    gives them its records (`records`, `_check_images`, `_datasets`, `_make_inputs`), its
    image, loader and cache settings, and the state `_init_state` sets: `_encoder`,
    `_encoder_config`, `_cache_device` and `device_grids`."""

    _encoder: Any
    _encoder_config: dict[str, Any]
    _cache_device: Any
    device_grids: DeviceGrids
    trainer: Any

    def use_encoder_cache(self, encoder: Any, encoder_config: dict[str, Any], *,
                          device: Any = None, checked: Collection[str] = ()) -> None:
        """Serve cached annotation grids of a frozen `encoder` instead of images.

        Each split's grids are computed once (`captioning.data.features.FeatureCache`) and
        memory-mapped; datasets already set up switch their inputs in place. `checked`: array
        files that another process has just opened under `cache_verify` (rank zero's
        `opened_caches`), opened here after a size check only.
        """
        if self._encoder is not None and encoder_config == self._encoder_config:
            return  # already served from these caches (a later stage of the same run)
        if self.hflip:
            log.warning("feature cache: hflip is ignored, cached features are never flipped")
        self._encoder, self._encoder_config, self._cache_device = encoder, encoder_config, device
        self._checked_caches = frozenset(checked)
        for split, ds in self._datasets.items():
            ds.inputs = self._make_inputs(self.records(split), split)

    def cache_features(self, splits: Sequence[str] = DATA_SPLITS,
                       ) -> dict[str, FeatureCache]:
        """Build (or find) the feature cache of each non-empty split; after `use_encoder_cache`.

        Images are checked first (`validate_images`, `on_bad_data`), as `setup` would.
        Returns {split: FeatureCache}.
        """
        if self._encoder is None:
            raise RuntimeError("call use_encoder_cache(encoder, key) before cache_features()")
        out: dict[str, FeatureCache] = {}
        for split in splits:
            if not self.records(split):
                continue
            self._check_images(split)
            out[split] = self._build_cache(self.records(split), split)
        return out

    def cache_root(self) -> Path:
        """Where the feature caches go: `cache_dir`, else the source's `cache_root()`."""
        return Path(self.cache_dir) if self.cache_dir else self.source.cache_root()

    def _build_cache(self, records: Sequence[ImageRecord], split: str) -> FeatureCache:
        try:
            cache = FeatureCache.build(
                cache_dir=self.cache_root(), encoder=self._encoder,
                encoder_config=self._encoder_config, image_size=self.image_size,
                paths=[r.path for r in records], transform=self.image_transform(False),
                batch_size=self.eval_batch_size, num_workers=self.num_workers,
                device=self._cache_device, progress=f"caching {split} features",
                verify=self.cache_verify, checked=self._checked_caches)
        except ImageLoadError as e:  # the first bad image met (unchecked, or damaged within)
            raise DataError(unchecked_image(records, split, e,
                                            validated=self.validate_images)) from None
        self.opened_caches.add(str(cache.array_path))  # once, however often it is opened
        return cache

    def hold_grids(self, device: str | torch.device, *, stage: str | None = None,
                   agree: Callable[[bool], bool] | None = None) -> None:
        """Hold the grids of the stage's splits (None: all) on `device` (`DeviceGrids.hold`;
        `agree`: every rank's verdict, `distributed.agreement`)."""
        self.device_grids.hold(device, STAGE_SPLITS.get(stage, DATA_SPLITS), agree=agree)

    def teardown(self, stage: str) -> None:
        """The stage's grids leave the device (a later stage copies what it needs again)."""
        self.device_grids.release(STAGE_SPLITS.get(stage, DATA_SPLITS))

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """A batch's inputs cast by the precision plugin ("-true" precisions; Lightning's own
        cast, before the transfer, passes a `CaptionBatch` over), on the device. A batch of
        `GridRows` gets its (B, L, D) grids from the device first (held first where they are
        not). Other batches pass."""
        if not isinstance(batch, CaptionBatch):
            return batch
        images, trainer = batch.images, self.trainer
        if batch.grid_split is not None:
            device = batch.captions.device
            if batch.grid_split not in self.device_grids.held:  # every rank meets its first
                self.hold_grids(device, stage=SPLIT_STAGE[batch.grid_split],
                                agree=agreement(trainer and trainer.strategy))
            images = self.device_grids.gather(batch.grid_split, images, device)
        if trainer is not None:  # e.g. bf16-true: bfloat16 (mixed precisions: as it is)
            images = trainer.precision_plugin.convert_input(images)
        if images is batch.images and batch.grid_split is None:
            return batch
        return batch.replace(images=images, grid_split=None)


def attach_feature_cache(datamodule: Any, encoder: nn.Module, key: dict[str, Any], *,
                         strategy: Any = None, device: str | torch.device | None = None,
                         stage: str | None = None) -> None:
    """Serve `datamodule`'s inputs from the feature cache of a frozen `encoder`: the one attach
    path of `fit`, `cache-features` and the benchmark.

    `key` is what the grids depend on besides the images (`Captioner.feature_cache_key()`).
    With a Lightning `strategy` (several processes), rank zero builds the cache while the
    others wait for its outcome, then open it; where rank zero fails, every rank stops with its
    error line. The files rank zero has just opened under `cache_verify` are not hashed again
    by every other rank: they check their sizes only (files of other names, as images copied
    per node give, get the full check). Building never shifts the RNG streams. Then, with
    `features_on_device`, the data module holds `stage`'s grids on `device` (`hold_grids`).
    """
    from lightning.pytorch.utilities.seed import isolate_rng

    if strategy is not None and device is None:
        device = strategy.root_device
    with isolate_rng():
        if strategy is None:
            datamodule.use_encoder_cache(encoder, key, device=device)
        else:
            def on_rank_zero() -> list[str]:
                datamodule.use_encoder_cache(encoder, key, device=device)
                return sorted(getattr(datamodule, "opened_caches", ()))

            checked = rank_zero_result(strategy, on_rank_zero, what="build the feature cache")
            if not strategy.is_global_zero:
                datamodule.use_encoder_cache(encoder, key, device=device, checked=checked)
    if getattr(datamodule, "features_on_device", False) and device is not None:
        datamodule.hold_grids(device, stage=stage, agree=agreement(strategy))
