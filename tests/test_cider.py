"""Vectorised CIDEr-D against pycocoevalcap's CiderScorer, fed the same tokens (no Java)."""

from __future__ import annotations

import json
import random
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from pycocoevalcap.cider.cider_scorer import CiderScorer

from captioning.cider import CiderD
from captioning.data.shapes import SPLIT_FILE
from captioning.vocab import SPECIALS, tokenize

Refs = dict[int, list[list[str]]]


@pytest.fixture(scope="module")
def splits(shapes_root: Path) -> dict[str, Refs]:
    """{split: {image id: tokenised references}} of the session's shapes data."""
    data = json.loads((shapes_root / SPLIT_FILE).read_text())
    out: dict[str, Refs] = defaultdict(dict)
    for image in data["images"]:
        out[image["split"]][image["cocoid"]] = [tokenize(s["raw"]) for s in image["sentences"]]
    return dict(out)


def candidates(splits: dict[str, Refs], seed: int = 0) -> tuple[list[list[str]], list[int]]:
    """Per test image: another test image's reference, a training reference, its own
    reference, random word sequences (lengths 0..12), repeated n-grams and an empty one."""
    rng = random.Random(seed)
    test, train = splits["test"], splits["train"]
    words = sorted({w for refs in (*test.values(), *train.values()) for r in refs for w in r})
    ids = list(test)
    cands: list[list[str]] = []
    rows: list[int] = []
    for j, image in enumerate(ids):
        other = test[ids[(j + 1) % len(ids)]]
        own = test[image]
        cands += [other[0], rng.choice(list(train.values()))[1], own[2],
                  [rng.choice(words) for _ in range(rng.randint(0, 12))],
                  [rng.choice(words) for _ in range(rng.randint(1, 5))] + ["zebra", "xylophone"],
                  own[0][:2] * 3, [own[0][0]] * 5, []]
        rows += [image] * 8
    return cands, rows


def pycoco_scores(cands: list[list[str]], rows: list[int], refs: Refs, *,
                  df: dict[tuple[str, ...], float] | None = None,
                  num_docs: int | None = None) -> np.ndarray:
    """pycocoevalcap's per-candidate scores: corpus df, or the given df over num_docs documents
    (what ruotianluo's CiderD does with a precomputed df)."""
    scorer = CiderScorer(n=4, sigma=6.0) if df is None else _GivenDf(df, num_docs or 0)
    for cand, image in zip(cands, rows):
        scorer += (" ".join(cand), [" ".join(r) for r in refs[image]])
    if df is None:
        return scorer.compute_score()[1]
    scorer.compute_doc_freq()
    return np.array(scorer.compute_cider())


class _Sized(list):  # type: ignore[type-arg]
    """A list whose len() is the number of df documents (CiderScorer takes D = len(crefs))."""

    def __init__(self, items: list[Any], size: int) -> None:
        super().__init__(items)
        self.size = size

    def __len__(self) -> int:
        return self.size


class _GivenDf(CiderScorer):
    """CiderScorer with given document frequencies over `num_docs` documents."""

    def __init__(self, df: dict[tuple[str, ...], float], num_docs: int) -> None:
        super().__init__(n=4, sigma=6.0)
        self.given, self.num_docs = df, num_docs

    def compute_doc_freq(self) -> None:
        self.document_frequency = defaultdict(float, self.given)

    def compute_cider(self) -> list[float]:
        crefs = self.crefs
        self.crefs = _Sized(crefs, self.num_docs)
        try:
            return super().compute_cider()
        finally:
            self.crefs = crefs


def training_df(refs: Refs) -> dict[tuple[str, ...], float]:
    """pycocoevalcap's own document frequencies of the training references."""
    scorer = CiderScorer(n=4, sigma=6.0)
    for image_refs in refs.values():
        scorer += ("", [" ".join(r) for r in image_refs])
    scorer.compute_doc_freq()
    return dict(scorer.document_frequency)


# -- agreement ---------------------------------------------------------------------------------
def test_corpus_mode_agrees_with_pycocoevalcap(splits: dict[str, Refs]) -> None:
    cands, rows = candidates(splits)
    test = splits["test"]
    one = [8 * j for j in range(len(test))]  # one candidate per image: pycocoevalcap's Cider
    for pick in (one, list(range(len(rows)))):  # ... and 8 rows per image (8 documents each)
        c, r = [cands[i] for i in pick], [rows[i] for i in pick]
        want = pycoco_scores(c, r, test)
        got = CiderD(test, df="corpus").score(c, r)
        assert got.shape == (len(pick),) and got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert (want > 1.0).any() and (want == 0).any()  # varied: matches and misses


def test_training_document_frequencies_agree_with_pycocoevalcap(splits: dict[str, Refs]) -> None:
    cands, rows = candidates(splits, seed=1)
    train, test = splits["train"], splits["test"]
    want = pycoco_scores(cands, rows, test, df=training_df(train), num_docs=len(train))
    cider = CiderD(test, df_references=train.values())
    np.testing.assert_allclose(cider.score(cands, rows), want, rtol=0, atol=1e-6)
    # Scoring the training images themselves: df from their references is pycocoevalcap's
    # corpus df over one candidate per training image.
    ids = list(train)
    own = [train[ids[(j + 3) % len(ids)]][j % 5] for j in range(len(ids))]
    np.testing.assert_allclose(CiderD(train).score(own, ids), pycoco_scores(own, ids, train),
                               rtol=0, atol=1e-6)


def test_token_ids_score_as_their_words(splits: dict[str, Refs]) -> None:
    cands, rows = candidates(splits, seed=2)
    train = splits["train"]
    words = [*SPECIALS, *sorted({w for c in cands for w in c} - {"xylophone"})]
    stoi = {w: i for i, w in enumerate(words)}
    known = [[w for w in c if w in stoi] for c in cands]
    T = max(map(len, known))
    tokens = torch.zeros(len(known), T + 1, dtype=torch.long)  # then <end>, <pad>
    for i, c in enumerate(known):
        tokens[i, : len(c)] = torch.tensor([stoi[w] for w in c], dtype=torch.long)
        tokens[i, len(c)] = stoi["<end>"]
    lengths = torch.tensor([len(c) for c in known])
    refs = {**train, **splits["test"]}
    cider = CiderD(refs, df_references=train.values(), words=words)
    got = cider.score_ids(tokens, lengths, rows)
    assert got.dtype == torch.float64 and got.shape == (len(known),)
    np.testing.assert_allclose(got.numpy(), cider.score(known, rows), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="words"):
        CiderD(refs).score_ids(tokens, lengths, rows)


# -- edge cases --------------------------------------------------------------------------------
def test_edge_cases() -> None:
    refs = {"a": [["a", "red", "circle"], ["a", "red", "circle", "left", "of", "a", "square"]],
            "b": [["two", "blue", "squares"]], "c": [["one", "green", "triangle"]]}
    cider = CiderD(refs)
    cands = [[], ["a", "red", "circle"], ["red", "red", "red", "red", "red"], ["red"],
             ["a", "red", "circle", "a", "red", "circle"], ["never", "seen", "words"]]
    rows = ["a"] * len(cands)
    got = cider.score(cands, rows)
    D = len(refs)
    scorer = _GivenDf(training_df(refs), D)
    for cand in cands:
        scorer += (" ".join(cand), [" ".join(r) for r in refs["a"]])
    scorer.compute_doc_freq()
    np.testing.assert_allclose(got, scorer.compute_cider(), rtol=0, atol=1e-9)
    assert got[0] == 0.0 and got[-1] == 0.0  # empty, and nothing in common
    assert got[1] == got.max() > 0  # equal to a reference: the best of these
    assert got[4] < got[1] and got[2] < got[1]  # repeats are clipped and length-penalised
    assert cider.score([], []).shape == (0,)


def test_bad_inputs() -> None:
    refs = {1: [["a", "b"]], 2: [["c"]]}
    with pytest.raises(ValueError, match="no references for image id 3"):
        CiderD(refs).score([["a"]], [3])
    with pytest.raises(ValueError, match="without references"):
        CiderD({1: [["a"]], 2: []})
    with pytest.raises(ValueError, match="candidates"):
        CiderD(refs).score([["a"]], [1, 2])
    with pytest.raises(ValueError, match="df must be"):
        CiderD(refs, df="train")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="distinct words"):  # n = 8 packs words in 8 bits
        CiderD({1: [[f"w{i}" for i in range(300)]]}, n=8)
