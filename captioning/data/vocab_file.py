"""The vocabulary file that runs share (`CaptionDataModule(vocab_path=...)`): loaded and checked
against what this run would build, or built and saved."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

from captioning.atomic import write_json_atomic
from captioning.data.problems import DataError, Problem
from captioning.vocab import Vocabulary, origin_differences

log = logging.getLogger(__name__)

ORIGIN_KEY = "origin"  # beside "words" in the file


def load_or_build_vocab(path: str | Path | None, build: Callable[[], Vocabulary]) -> Vocabulary:
    """The vocabulary at `path` when that file exists, else `build()`'s, saved there (when a
    path is given) with its origin (`vocab_origin`: settings and a digest of the captions' word
    counts). Where a file's origin differs from what this run would build, DataError names the
    file and each field, and the file is kept. A file without an origin (a word list from
    elsewhere, such as an exported model's) is used as it is."""
    if path is None or not Path(path).exists():
        vocab = build()
        origin = vocab.origin or {}
        log.info("built vocabulary of %d words (min_count=%s, max_size=%s)", len(vocab),
                 origin.get("min_count"), origin.get("max_size"))
        if path is not None:  # written atomically: DDP ranks may race here
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {**vocab.to_dict(), ORIGIN_KEY: vocab.origin}, indent=None)
        return vocab
    vocab = Vocabulary.load(path)
    saved = json.loads(Path(path).read_text()).get(ORIGIN_KEY)
    if isinstance(saved, dict):  # built from this run's captions, with its settings?
        differ = origin_differences(saved, build().origin or {})
        if differ:
            raise DataError(Problem(str(path), ORIGIN_KEY, key, f"{why}; the file is kept: "
                                    "delete it to build the vocabulary again, or pass another "
                                    "data.vocab_path") for key, why in differ.items())
    log.info("loaded vocabulary of %d words from %s", len(vocab), path)
    return vocab
