"""A data source read under the data module's `on_bad_data`: with "fail", every problem found in
one `DataError` (the annotations', then the images' of the other entries); a missing file
names the source setting that gives it."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from captioning.data.images import image_problems
from captioning.data.problems import DataError, Problem, naming_settings
from captioning.data.readers import DATA_SPLITS, ImageRecord, OnError, split_overlaps
from captioning.data.sources import DataSource, SourceRecords

log = logging.getLogger(__name__)


def bad_images(records: Sequence[ImageRecord], reasons: Sequence[str | None],
               split: str) -> list[Problem]:
    """The problems of the images that `image_problems` found bad (`reasons`)."""
    return [Problem(str(r.path), f"{split} image {r.image_id!r}", "image", why)
            for r, why in zip(records, reasons) if why is not None]


def read_source(source: DataSource, on_bad_data: OnError, *,
                validate_images: bool) -> SourceRecords:
    """`source.read` under `on_bad_data`; with "fail" the annotations are read as with
    "skip", so that their problems and the other entries' bad images (`validate_images`)
    come in one error; a split that leaks into another is an error either way."""
    try:
        read = _read(source, on_bad_data)
    except DataError as e:  # a missing file: which setting names it
        raise DataError(naming_settings(e.problems, source.config()["init_args"])) from None
    except ValueError as e:  # the source's own check of its splits (carving val and test)
        where = source.describe("train")
        why = str(e).removeprefix(f"{where}: ")
        raise DataError([Problem(where, "(splits)", "val/test", why)]) from None
    leaks = split_overlaps(read.splits, source.describe)
    if on_bad_data == "fail" and read.problems:
        images: list[Problem] = []
        if validate_images:
            t0 = time.perf_counter()
            log.info("the annotations have %d problems; checking the other entries' images "
                     "too, to list every problem at once", len(read.problems))
            for split in DATA_SPLITS:
                records = read.splits.get(split, [])
                images += bad_images(records, image_problems([r.path for r in records]), split)
            log.info("checked the images in %.1fs", time.perf_counter() - t0)
        raise DataError([*read.problems, *leaks, *images])
    if leaks:
        raise DataError(leaks)
    return read


def _read(source: DataSource, on_bad_data: OnError) -> SourceRecords:
    if on_bad_data != "fail":
        return source.read(on_bad_data)
    try:
        return source.read("skip")  # every problem, raised by the caller
    except DataError:
        raise
    except ValueError:  # the source's own check of what was kept (carving val/test out of
        return source.read("fail")  # train): the annotations' problems come first
