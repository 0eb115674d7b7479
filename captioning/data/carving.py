"""Carving val and test out of another split, when a source has none of their images: each
image's place hangs on its own id (`carve`), and a checkpoint records the rule (`CARVING`), so
that a later run never evaluates it on images it trained on (`carving_problem`)."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from captioning.data.problems import DataError, Problem
from captioning.data.readers import ImageRecord


class Described(Protocol):
    """What `carving_problem` reads of a data source (`sources.DataSource` has both)."""

    def same_data(self, config: Any) -> bool: ...

    def describe(self, split: str) -> str: ...

#: How `carve` chooses images; a checkpoint records it (`CaptioningModule`), and evaluating
#: a checkpoint whose run carved the same source another way is refused (`carving_problem`).
CARVING = 2
CARVING_KEY = "captioning_carving"  # where a checkpoint records it
UNRECORDED_KEY = "unrecorded_folder"  # `carving_record` of a folder that names no source
log = logging.getLogger(__name__)


def carve_rank(image_id: Any) -> tuple[bytes, str]:
    """An image's place in the carving order: a hash of its id alone (then the id)."""
    text = str(image_id)
    return hashlib.blake2b(text.encode(), digest_size=8, person=b"carve").digest(), text


def carve(records: list[ImageRecord], sizes: Mapping[str, int]
          ) -> tuple[list[ImageRecord], dict[str, list[ImageRecord]]]:
    """(the rest, {split: its carved records}): test takes the `sizes["test"]` records first in
    `carve_rank` order, val the next ones. An image's rank hangs on its own id only, so adding,
    dropping or skipping other images moves at most as many images across a boundary, and with
    the sizes kept a training image reaches test only when more carved images drop out than val
    holds: carved splits stay put whatever the file order or the data module's seed."""
    ordered = sorted(records, key=lambda r: carve_rank(r.image_id))
    carved: dict[str, list[ImageRecord]] = {}
    start = 0
    for split in sorted(sizes, key=lambda s: s != "test"):  # test first: the rarest boundary
        carved[split] = ordered[start:start + sizes[split]]
        start += sizes[split]
    chosen = {id(r) for part in carved.values() for r in part}
    return [r for r in records if id(r) not in chosen], carved


def carving_problem(saved: Mapping[str, Any] | None, rule: Any, source: Described,
                    carved: Sequence[str]) -> Problem | None:
    """Why a checkpoint must not be used with `source`'s carved splits: its run read the same
    source (`saved`: its data module's hyperparameters) but carved it by another `rule` (the
    checkpoint's `CARVING`, None before it was recorded), so the splits carved now may hold
    images it trained on. None when nothing stands against it."""
    if not carved or not isinstance(saved, Mapping) or not source.same_data(saved.get("source")):
        return None
    if rule == CARVING:
        return None
    return Problem(source.describe(carved[0]), "(splits)", "/".join(carved),
                   "the checkpoint's run carved these splits out by an earlier rule, so the "
                   "images carved now may include images it trained on: use the version of "
                   "captioning that trained it, or give the source its own val and test files")


def check_carving(checkpoint: Mapping[str, Any], datamodule: Any) -> None:
    """Raise `carving_problem` (DataError) for a data module (one with `source` and `carved`)
    about to be used with a checkpoint (a Lightning one records its data module's settings).
    A folder's record without a source (`UNRECORDED_KEY`) cannot be checked: a warning."""
    source, carved = getattr(datamodule, "source", None), getattr(datamodule, "carved", ())
    if UNRECORDED_KEY in checkpoint:
        if carved:
            log.warning("%s records no data source (its config.json has no trained_on): "
                        "whether the %s images carved now include images its run trained "
                        "on cannot be checked", checkpoint[UNRECORDED_KEY], "/".join(carved))
        return
    problem = None if source is None else carving_problem(
        checkpoint.get("datamodule_hyper_parameters"), checkpoint.get(CARVING_KEY), source, carved)
    if problem is not None:
        raise DataError([problem])


def carving_record(trained_on: Mapping[str, Any], folder: str) -> dict[str, Any]:
    """An exported folder's `trained_on` ({"source": ..., "carving": ...}) as the checkpoint
    keys `check_carving` reads; where it records no source, the folder under
    `UNRECORDED_KEY`."""
    if not isinstance(trained_on, Mapping) or not trained_on.get("source"):
        return {UNRECORDED_KEY: folder}
    return {"datamodule_hyper_parameters": {"source": trained_on["source"]},
            CARVING_KEY: trained_on.get("carving")}
