"""Self-critical sequence training (Rennie et al. 2017): settings, rewards and baselines.

The objective itself, `captioning.objectives.SelfCritical`, samples k captions per image and
minimises −Σ (r(wˢ) − b) log p(wˢ). This module holds what it needs that does not touch the
network, so that it can be tested on plain tensors:

* `ScstConfig`: the `model.scst` settings;
* `ScstReward`: r(w), the CIDEr-D of a caption's words against its image's training references
  (document frequencies from those references, counted once), optionally plus a weighted
  sentence BLEU-4 (`SentenceBleu`, pycocoevalcap's per-sentence BLEU-4);
* `words_only`, `first_of_each`, `mean_of_others`: special tokens out, one row per image, and
  the "new SCST" baseline (ruotianluo/ImageCaptioning.pytorch).
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, Protocol

import numpy as np
import torch
from torch import Tensor

from captioning.choices import check_choice
from captioning.cider import CiderD
from captioning.vocab import SPECIALS, Vocabulary, tokenize

Baseline = Literal["greedy", "mean"]
RewardKind = Literal["cider", "cider_bleu"]


@dataclass(frozen=True)
class ScstConfig:
    """`model.scst`: how SCST samples, rewards and baselines (used with `objective: scst`).

    `baseline`: `greedy`, the reward of the greedy caption (Rennie et al. 2017), or `mean`, the
    mean reward of the image's other k − 1 samples. `reward`: `cider` (CIDEr-D) or `cider_bleu`
    (CIDEr-D + `bleu_weight` · BLEU-4). `xe_weight` adds the model's cross-entropy objective on
    the batch's captions (for hard attention with its REINFORCE and entropy terms); 0: off.
    """

    samples: int = 5  # k sampled captions per image
    baseline: Baseline = "greedy"
    temperature: float = 1.0  # words drawn from softmax(logits / temperature)
    max_len: int = 20  # words per sampled (and greedy) caption, <end> included
    reward: RewardKind = "cider"
    bleu_weight: float = 0.5  # r = CIDEr-D + bleu_weight · BLEU-4 with `reward: cider_bleu`
    xe_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.samples < 1 or self.max_len < 1:
            raise ValueError(f"scst.samples and scst.max_len must be >= 1, got {self.samples} "
                             f"and {self.max_len}")
        check_choice("scst.baseline", self.baseline, Baseline)
        if self.baseline == "mean" and self.samples < 2:
            raise ValueError("scst.baseline 'mean' averages the other samples of an image: "
                             f"scst.samples must be >= 2, got {self.samples}")
        check_choice("scst.reward", self.reward, RewardKind)
        if not self.temperature > 0 or self.bleu_weight < 0 or self.xe_weight < 0:
            raise ValueError("scst.temperature must be > 0, scst.bleu_weight and scst.xe_weight "
                             f">= 0; got {self.temperature}, {self.bleu_weight}, {self.xe_weight}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ScstConfig:
        unknown = sorted(set(data) - {f.name for f in fields(cls)})
        if unknown:
            raise ValueError(f"ScstConfig has unknown fields {unknown}")
        return cls(**data)


class Record(Protocol):
    """What the reward reads from a data record (`captioning.data.readers.ImageRecord`)."""

    image_id: Any
    captions: Sequence[str]


def references_of(records: Iterable[Record]) -> dict[Hashable, list[list[str]]]:
    """{image id: its captions as words}, tokenised as the training targets are."""
    refs: dict[Hashable, list[list[str]]] = {}
    for r in records:
        words = [w for w in (tokenize(c) for c in r.captions) if w]
        if words:
            refs.setdefault(r.image_id, []).extend(words)
    return refs


class SentenceBleu:
    """pycocoevalcap's per-sentence BLEU-4 (the second value of `Bleu(4).compute_score`):
    (Π_{n≤4} (clipped_n + 1e-15) / (guessed_n + 1e-9))^{1/4}, times the brevity penalty
    against the reference length closest to the candidate's. On words, in plain Python."""

    def __init__(self, references: Mapping[Hashable, Sequence[Sequence[str]]], *,
                 n: int = 4) -> None:
        self.n = n
        self.references = references
        self._cooked: dict[Hashable, tuple[list[int], dict[tuple[str, ...], int]]] = {}

    def _ngrams(self, words: Sequence[str]) -> dict[tuple[str, ...], int]:
        counts: dict[tuple[str, ...], int] = {}
        for k in range(1, self.n + 1):
            for i in range(len(words) - k + 1):
                g = tuple(words[i : i + k])
                counts[g] = counts.get(g, 0) + 1
        return counts

    def _refs(self, image: Hashable) -> tuple[list[int], dict[tuple[str, ...], int]]:
        """(reference lengths, max count of each n-gram over the references), cached."""
        if image not in self._cooked:
            most: dict[tuple[str, ...], int] = {}
            for ref in self.references[image]:
                for g, c in self._ngrams(ref).items():
                    most[g] = max(most.get(g, 0), c)
            self._cooked[image] = ([len(r) for r in self.references[image]], most)
        return self._cooked[image]

    def sentence(self, words: Sequence[str], image: Hashable) -> float:
        lengths, most = self._refs(image)
        correct = [0] * self.n
        for g, c in self._ngrams(words).items():
            correct[len(g) - 1] += min(most.get(g, 0), c)
        score = 1.0
        for k in range(self.n):  # the running product, as BleuScorer.compute_score
            score *= (correct[k] + 1e-15) / (max(0, len(words) - k) + 1e-9)
        score **= 1.0 / self.n
        ref_len = min((abs(n - len(words)), n) for n in lengths)[1]
        ratio = (len(words) + 1e-15) / (ref_len + 1e-9)
        return score * math.exp(1 - 1 / ratio) if ratio < 1 else score

    def score(self, candidates: Sequence[Sequence[str]],
              image_ids: Sequence[Hashable]) -> np.ndarray:
        """(N,) float64 BLEU-4 of each candidate against its image's references."""
        return np.array([self.sentence(c, i) for c, i in zip(candidates, image_ids)])


def words_only(tokens: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Token rows (N, T) with their emitted lengths (N,) -> the same rows with every special
    token (<pad>, <start>, <end>, <unk>) removed and the words moved to the front, and each
    row's word count (N,): what the metrics score (`Vocabulary.decode`)."""
    pos = torch.arange(tokens.size(1), device=tokens.device)
    keep = (pos < lengths.unsqueeze(1)) & (tokens >= len(SPECIALS))  # (N, T)
    order = torch.argsort((~keep).to(torch.int8), dim=1, stable=True)  # words first, in order
    return tokens.gather(1, order), keep.sum(dim=1)


class ScstReward:
    """r(w) for token-id captions: CIDEr-D against the image's references (document frequencies
    from all of `references`, counted once), plus `bleu_weight` · BLEU-4 for `cider_bleu`."""

    def __init__(self, references: Mapping[Hashable, Sequence[Sequence[str]]],
                 vocab: Vocabulary, *, kind: RewardKind = "cider",
                 bleu_weight: float = 0.5) -> None:
        self.vocab = vocab
        self.cider = CiderD(references, words=vocab.itos)  # df: these references
        self.bleu = SentenceBleu(references) if kind == "cider_bleu" else None
        self.bleu_weight = bleu_weight

    def __call__(self, tokens: Tensor, lengths: Tensor,
                 image_ids: Sequence[Hashable]) -> Tensor:
        """(N,) float32 rewards of token rows (N, T) whose first lengths[i] tokens were emitted
        (<end> included or not: special tokens are dropped), on the tokens' device."""
        words, counts = words_only(tokens, lengths)
        r = self.cider.score_ids(words, counts, image_ids)  # (N,) float64
        if self.bleu is not None:
            texts = [[self.vocab.itos[t] for t in row[:n]]
                     for row, n in zip(words.tolist(), counts.tolist())]
            bleu = torch.from_numpy(self.bleu.score(texts, image_ids)).to(r.device)
            r = r + self.bleu_weight * bleu
        return r.float()


def first_of_each(image_ids: Sequence[Hashable]) -> tuple[list[int], list[Hashable]]:
    """(the first row of each distinct image id, those ids), in batch order: a batch of
    (image, caption) pairs becomes one row per image."""
    first: dict[Hashable, int] = {}
    for i, image in enumerate(image_ids):
        first.setdefault(image, i)
    return list(first.values()), list(first)


def mean_of_others(rewards: Tensor) -> Tensor:
    """b_ij = (Σ_j' r_ij' − r_ij) / (k − 1): each of an image's k samples (U, k) against the
    mean reward of its other samples, never its own (the "new SCST" baseline)."""
    k = rewards.size(1)
    return (rewards.sum(dim=1, keepdim=True) - rewards) / (k - 1)
