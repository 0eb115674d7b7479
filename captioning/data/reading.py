"""A data source read under the data module's `on_bad_data`: with "fail", every problem found in
one `DataError` (the annotations', then the images' of the other entries); a missing file
names the source setting that gives it."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from captioning.data.images import ImageLoadError, image_problems
from captioning.data.problems import MISSING, DataError, Problem, naming_settings
from captioning.data.readers import DATA_SPLITS, ImageRecord, OnError, split_overlaps
from captioning.data.sources import DataSource, SourceRecords

log = logging.getLogger(__name__)


def bad_images(records: Sequence[ImageRecord], reasons: Sequence[str | None], split: str,
               settings: Mapping[str, Any] | None = None) -> list[Problem]:
    """The problems of the images that `image_problems` found bad (`reasons`). Where none of
    several images exists, first the source setting (of `settings`, its init_args) naming the
    folder they were looked for in: most likely the wrong folder."""
    bad = [Problem(str(r.path), f"{split} image {r.image_id!r}", "image", why)
           for r, why in zip(records, reasons) if why is not None]
    if len(records) < 2 or any(why != MISSING for why in reasons):
        return bad
    folders = {k: Path(v) for k, v in (settings or {}).items() if isinstance(v, str) and v}
    key = next((k for k, v in folders.items()
                if all(v in Path(r.path).parents for r in records)), None)
    if key is None:
        return bad
    return [Problem(str(folders[key]), "(folder)", f"data.source.{key}",
                    f"none of the {len(records)} {split} images exists under it: pass "
                    f"--data.source.{key} with the folder that holds them"), *bad]


def unchecked_image(records: Sequence[ImageRecord], split: str, error: ImageLoadError, *,
                    validated: bool = False) -> list[Problem]:
    """The problem of the bad image `error` met while decoding: its entry among `records` (by
    path); unless the images were `validated` up front (a header check, no pixel decoding:
    a damaged body or a file replaced since passes it), how to have every bad image listed
    before any step."""
    found = [r for r in records if Path(r.path).resolve() == error.path.resolve()]
    hint = "" if validated else (
        "; data.validate_images is false: set it true to list every bad image before any "
        "step (with data.on_bad_data: skip, to leave them out)")
    why = (error.reason or "cannot be read") + hint
    return bad_images(found[:1], [why], split) if found else [
        Problem(str(error.path), f"{split} image", "image", why)]


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
    warn_listed_twice(read.splits)
    if on_bad_data == "fail" and read.problems:
        images: list[Problem] = []
        if validate_images:
            t0 = time.perf_counter()
            log.info("the annotations have %d problems; checking the other entries' images "
                     "too, to list every problem at once", len(read.problems))
            for split in DATA_SPLITS:
                records = read.splits.get(split, [])
                images += bad_images(records, image_problems([r.path for r in records]), split,
                                     source.config()["init_args"])
            log.info("checked the images in %.1fs", time.perf_counter() - t0)
        raise DataError([*read.problems, *leaks, *images])
    if leaks:
        raise DataError(leaks)
    return read


def warn_listed_twice(by_split: Mapping[str, Sequence[ImageRecord]]) -> dict[str, int]:
    """Warn, once a split, of image files its records list under more than one id (each
    listing then counts as an image: weighted twice in training, scored twice in test);
    returns how many files each split lists twice."""
    counts = {}
    for split, records in by_split.items():
        first: dict[str, ImageRecord] = {}
        twice = []
        for r in records:
            seen = first.setdefault(os.path.normpath(r.path), r)
            if seen is not r:
                twice.append((seen, r))
        if twice:
            a, b = twice[0]
            log.warning("%d image files are listed twice in the %s split under other ids "
                        "(first: %s, as %r and %r); each listing counts as an image",
                        len(twice), split, a.path, a.image_id, b.image_id)
            counts[split] = len(twice)
    return counts


def _read(source: DataSource, on_bad_data: OnError) -> SourceRecords:
    if on_bad_data != "fail":
        return source.read(on_bad_data)
    try:
        return source.read("skip")  # every problem, raised by the caller
    except DataError:
        raise
    except ValueError:  # the source's own check of what was kept (carving val/test out of
        return source.read("fail")  # train): the annotations' problems come first
