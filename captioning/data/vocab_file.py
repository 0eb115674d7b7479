"""The vocabulary file that runs share (`CaptionDataModule(vocab_path=...)`): built and saved
with its origin once, then loaded; a training run checks the origin against its own."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from captioning.atomic import write_json_atomic
from captioning.data.problems import DataError, Problem
from captioning.vocab import Vocabulary, origin_differences

log = logging.getLogger(__name__)

ORIGIN_KEY = "origin"  # beside "words" in the file


def load_or_build_vocab(path: str | Path | None, build: Callable[[], Vocabulary]
                        ) -> tuple[Vocabulary, dict[str, Any] | None]:
    """(the vocabulary at `path` when that file exists, and the origin it records, if any); else
    (`build()`'s, None), saved there (when a path is given) with its origin (`vocab_origin`:
    the settings and a digest of the training captions' word counts), for `check_origin`."""
    if path is None or not Path(path).exists():
        vocab = build()
        origin = vocab.origin or {}
        log.info("built vocabulary of %d words (min_count=%s, max_size=%s)", len(vocab),
                 origin.get("min_count"), origin.get("max_size"))
        if path is not None:  # written atomically: DDP ranks may race here
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(path, {**vocab.to_dict(), ORIGIN_KEY: vocab.origin}, indent=None)
        return vocab, None
    vocab = Vocabulary.load(path)
    saved = json.loads(Path(path).read_text()).get(ORIGIN_KEY)
    log.info("loaded vocabulary of %d words from %s", len(vocab), path)
    return vocab, saved if isinstance(saved, dict) else None


def check_origin(path: str | Path, saved: dict[str, Any], loaded: Vocabulary,
                 built: Vocabulary) -> None:
    """Refuse to train with a vocabulary file built from other captions or settings than this
    run's (its `saved` origin against that of `built`, this run's vocabulary), or whose word
    list (`loaded`) is not the one its origin builds (edited or damaged since): DataError names
    the file and each field that differs; the file is kept. A file without an origin (a word
    list from elsewhere, such as an exported model's) is never checked, nor is any file
    outside training."""
    differ = origin_differences(saved, built.origin or {})
    if not differ and loaded.itos != built.itos:
        differ = {"words": _words_difference(loaded.itos, built.itos)}
    if differ:
        raise DataError(Problem(str(path), ORIGIN_KEY, key, f"{why}; pass another "
                                "data.vocab_path (the file is kept; delete it to build it again)")
                        for key, why in differ.items())


def _words_difference(saved: list[str], built: list[str]) -> str:
    missing = [w for w in built if w not in set(saved)]
    extra = [w for w in saved if w not in set(built)]
    if not missing and not extra:
        return "the same words in another order than its origin gives them (their ids differ)"
    shown = ", ".join([*(f"{w!r} missing" for w in missing[:3]),
                       *(f"{w!r} extra" for w in extra[:3])])
    return (f"{len(missing)} missing and {len(extra)} extra against the words its origin gives "
            f"({shown}): edited or damaged since it was built")
