"""Data: image loading, annotation readers, the shapes dataset, data sources, datasets,
samplers and the Lightning data module.

Names are imported lazily, so `from captioning.data.images import load_image` does not pull in
Lightning.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS: dict[str, str] = {
    "ImageLoadError": "images", "check_image": "images", "load_image": "images",
    "image_size_ok": "images",
    "DataError": "problems", "ImageRecord": "readers", "Problem": "problems",
    "Records": "readers", "read_coco_captions": "readers", "read_karpathy": "readers",
    "COLORS": "shapes", "SHAPES": "shapes", "SIZES": "shapes", "generate_shapes": "shapes",
    "parse_objects": "shapes", "scene_objects": "shapes",
    "IMAGENET_MEAN": "transforms", "IMAGENET_STD": "transforms",
    "boxes_to_crop_coords": "transforms", "build_image_transform": "transforms",
    "CocoCaptions": "sources", "DataSource": "sources", "KarpathySplits": "sources",
    "ObjectBoxes": "sources", "ShapesSource": "sources",
    "JsonlCaptions": "tables", "read_captions_table": "tables",
    "CaptionBatch": "datasets", "CaptionCollate": "datasets",
    "BucketBatchSampler": "samplers", "EpochShuffleSampler": "samplers",
    "CaptionDataModule": "datamodule",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{module}"), name)
