"""CIDEr-D as a fast reward: pycocoevalcap's `CiderScorer` arithmetic, vectorised with numpy.

No Java and no tokenizer: captions come as word lists (tokenised once, e.g. with
`captioning.vocab.tokenize`) or as token-id tensors with the model's word list. Each candidate c
gets pycocoevalcap's `Cider` score (which is CIDEr-D) against the references S of its image:

    10 / (n |S|) Σ_{s∈S} Σ_{k=1..n} e^(-δ²/2σ²) Σ_{g: k-gram} min(v_c(g), v_s(g)) v_s(g)
                                                               / (|v_c|_k |v_s|_k)

with v(g) = tf(g) (log D - log max(1, df(g))) for the D documents (one image's references each)
that define the document frequencies df, and δ the difference of the candidate's and the
reference's bigram counts (what pycocoevalcap calls their length).

Document frequencies (`df`):
* "references" (the reward): counted once, at construction, over `references` (or over
  `df_references`), as ruotianluo's `CiderD` with a precomputed df.
* "corpus": pycocoevalcap's `Cider`: over the references of the candidates being scored, one
  document per candidate row, D = the number of rows.

N-grams are integer keys: a word has a code below 2^(64 // n) and an n-gram packs its codes
into one uint64 (left-aligned, so n-grams of different lengths never collide). Counting,
document frequencies and candidate-reference matches are sorts, `searchsorted` and `bincount`
over flat arrays; no Python loop runs per n-gram.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import numpy as np

from captioning.choices import check_choice

if TYPE_CHECKING:
    from torch import Tensor

DocumentFrequency = Literal["references", "corpus"]
Sentences = Sequence[Sequence[str]]


@dataclass
class NGrams:
    """The distinct 1..n-grams of S sequences: one entry per (sequence, n-gram), sorted."""

    seq: np.ndarray  # (E,) int64 sequence index
    kid: np.ndarray  # (E,) int64 index of the n-gram in `distinct`
    order: np.ndarray  # (E,) int64 n-gram length - 1
    tf: np.ndarray  # (E,) float64 count in its sequence
    length: np.ndarray  # (S,) float64 bigram count: pycocoevalcap's "length"
    distinct: np.ndarray  # (K,) uint64 the distinct packed n-grams, sorted


def _first_of_runs(sorted_values: np.ndarray) -> np.ndarray:
    """(n,) bool: where a run of equal values starts."""
    first = np.ones(sorted_values.size, dtype=bool)
    first[1:] = sorted_values[1:] != sorted_values[:-1]
    return first


def _packed(codes: np.ndarray, lengths: np.ndarray, n: int, bits: int
            ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sequence, packed key, length - 1) of every 1..n-gram occurrence of S sequences given
    as one flat array of word codes (Σ lengths,) and their lengths (S,)."""
    total = int(lengths.sum())
    seq = np.repeat(np.arange(lengths.size), lengths)  # (total,)
    pos = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    room = lengths[seq] - pos  # words from each position to its sequence's end
    padded = np.concatenate([codes.astype(np.uint64), np.zeros(n, np.uint64)])
    key = np.zeros(total, np.uint64)
    seqs, keys, orders = [], [], []
    for k in range(n):  # k-th word of every (k+1)-gram, packed from the top bits down
        key = key | (padded[k : k + total] << np.uint64(bits * (n - 1 - k)))
        ok = room > k
        seqs.append(seq[ok])
        keys.append(key[ok])
        orders.append(np.full(int(ok.sum()), k, np.int64))
    return np.concatenate(seqs), np.concatenate(keys), np.concatenate(orders)


def count_ngrams(codes: np.ndarray, lengths: np.ndarray, *, n: int, bits: int) -> NGrams:
    """The n-grams of S sequences (flat word codes (Σ lengths,), lengths (S,)) and their counts."""
    lengths = lengths.astype(np.int64)
    seq, key, order = _packed(codes, lengths, n, bits)
    by_key = np.argsort(key, kind="stable")
    first = _first_of_runs(key[by_key])
    distinct = key[by_key][first]  # (K,)
    kid = np.empty(key.size, np.int64)
    kid[by_key] = np.cumsum(first) - 1
    combo = seq * max(distinct.size, 1) + kid  # (sequence, n-gram) as one int64
    by_combo = np.argsort(combo)
    starts = np.flatnonzero(_first_of_runs(combo[by_combo]))
    tf = np.diff(np.append(starts, combo.size)).astype(np.float64)
    picked = by_combo[starts]
    bigrams = np.maximum(lengths - 1, 0) if n >= 2 else np.zeros_like(lengths)
    return NGrams(seq[picked], kid[picked], order[picked], tf, bigrams.astype(np.float64),
                  distinct)


def _ranges(starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
    """Concatenated aranges [starts[i], stops[i])."""
    sizes = stops - starts
    offsets = np.repeat(starts - (np.cumsum(sizes) - sizes), sizes)
    return np.arange(int(sizes.sum())) + offsets


def _lookup(ids: np.ndarray, values: np.ndarray, query: np.ndarray) -> np.ndarray:
    """values[ids == q] for each q of `query`; 0 where q is not among the sorted `ids`."""
    at = np.searchsorted(ids, query).clip(max=max(ids.size - 1, 0))
    found = (ids[at] == query) if ids.size else np.zeros(query.shape, dtype=bool)
    return np.where(found, values[at] if ids.size else 0.0, 0.0)


class CiderD:
    """CIDEr-D of candidate captions against the references of their images (see the module).

    `references` maps an image id to its tokenised references (at least one). `words` (the
    model's vocabulary, id -> word) enables `score_ids` on token-id tensors. Words must not
    contain whitespace (pycocoevalcap splits sentences on it).
    """

    def __init__(self, references: Mapping[Hashable, Sentences], *, n: int = 4,
                 sigma: float = 6.0, df: DocumentFrequency = "references",
                 df_references: Iterable[Sentences] | None = None,
                 words: Sequence[str] | None = None) -> None:
        if not 1 <= n <= 8:
            raise ValueError(f"n must be in 1..8, got {n}")
        if not sigma > 0:
            raise ValueError(f"sigma must be > 0, got {sigma}")
        check_choice("df", df, DocumentFrequency)
        self.n, self.sigma, self.df = n, sigma, df
        self._bits = 64 // n
        self.image_ids: list[Hashable] = list(references)
        self._index = {image: i for i, image in enumerate(self.image_ids)}
        refs = [[list(s) for s in references[image]] for image in self.image_ids]
        if empty := [image for image, r in zip(self.image_ids, refs) if not r]:
            raise ValueError(f"images without references: {empty[:5]}")
        docs = None if df_references is None else [[list(s) for s in d] for d in df_references]
        self._codes: dict[str, int] = {}
        for sentence in (s for group in (refs, docs or []) for r in group for s in r):
            for w in sentence:
                self._codes.setdefault(w, len(self._codes) + 1)
        self._check_codes(len(self._codes))
        self._build_references(refs)
        self._build_document_frequency(refs if docs is None else docs, docs is not None)
        self._id_codes = None if words is None else self._word_codes(words)
        del self._ref_grams, self._entry_image  # construction only

    # -- construction -----------------------------------------------------------------------
    def _check_codes(self, top: int) -> None:
        if top >= 1 << self._bits:
            raise ValueError(f"{top} distinct words: CIDEr-D with n = {self.n} packs words in "
                             f"{self._bits} bits, at most {(1 << self._bits) - 1} words")

    def _sentences_grams(self, groups: list[list[list[str]]]) -> tuple[NGrams, np.ndarray]:
        """N-grams of every sentence of `groups` (one group per image or document), and the
        group of each sentence (S,)."""
        sentences = [s for g in groups for s in g]
        codes = np.fromiter((self._codes[w] for s in sentences for w in s), np.uint64)
        lengths = np.fromiter((len(s) for s in sentences), np.int64, len(sentences))
        group = np.repeat(np.arange(len(groups)), [len(g) for g in groups])
        return count_ngrams(codes, lengths, n=self.n, bits=self._bits), group

    def _build_references(self, refs: list[list[list[str]]]) -> None:
        """Reference entries sorted by (image, n-gram), refs of an image contiguous."""
        grams, image_of_ref = self._sentences_grams(refs)
        self._ref_grams = grams
        counts = np.array([len(r) for r in refs], np.int64)
        self._ref_start = np.concatenate([[0], np.cumsum(counts)])  # (M + 1,)
        self._ref_length = grams.length  # (R,)
        self._entry_image = image_of_ref[grams.seq]  # (E,)

    def _build_document_frequency(self, docs: list[list[list[str]]], separate: bool) -> None:
        """The n-gram table (every reference and document n-gram), entry ids, and df."""
        refs = self._ref_grams
        if separate:
            doc_grams, doc_of = self._sentences_grams(docs)
            table = np.concatenate([refs.distinct, doc_grams.distinct])
            table = np.sort(table)
            self._gram_keys = table[_first_of_runs(table)]  # (G,)
            gid = np.searchsorted(self._gram_keys, refs.distinct)[refs.kid]
            doc_gid = np.searchsorted(self._gram_keys, doc_grams.distinct)[doc_grams.kid]
            doc_doc = doc_of[doc_grams.seq]
        else:
            self._gram_keys, gid = refs.distinct, refs.kid
            doc_gid, doc_doc = gid, self._entry_image
        G = self._gram_keys.size
        doc_combo = np.sort(doc_doc * G + doc_gid)
        doc_combo = doc_combo[_first_of_runs(doc_combo)]  # (document, n-gram) pairs
        self._df = np.bincount(doc_combo % G, minlength=G).astype(np.float64)  # (G,)
        self._num_docs = len(docs)
        combo = self._entry_image * G + gid
        order = np.argsort(combo, kind="stable")  # (image, n-gram), then reference
        self._combo, self._entry_gid = combo[order], gid[order]
        self._entry_ref = refs.seq[order]
        self._entry_order = refs.order[order]
        self._entry_tf = refs.tf[order]
        M = len(self.image_ids)
        self._entry_start = np.searchsorted(self._combo, np.arange(M + 1) * G)  # (M + 1,)

    def _word_codes(self, words: Sequence[str]) -> np.ndarray:
        """(V,) code of each model word id; words absent from the references get new codes."""
        top, codes = len(self._codes), []
        for w in words:
            if w in self._codes:
                codes.append(self._codes[w])
            else:
                top += 1
                codes.append(top)
        self._check_codes(top)
        return np.asarray(codes, np.uint64)

    # -- scoring ----------------------------------------------------------------------------
    def score(self, candidates: Sentences, image_ids: Sequence[Hashable]) -> np.ndarray:
        """(N,) float64 CIDEr-D of tokenised candidates, row i against image_ids[i]'s refs."""
        if len(candidates) != len(image_ids):
            raise ValueError(f"{len(candidates)} candidates but {len(image_ids)} image ids")
        unseen: dict[str, int] = {}
        top = len(self._codes)
        codes = np.fromiter((self._codes.get(w) or unseen.setdefault(w, top + 1 + len(unseen))
                             for s in candidates for w in s), np.uint64)
        self._check_codes(top + len(unseen))
        lengths = np.fromiter((len(s) for s in candidates), np.int64, len(candidates))
        return self._score(codes, lengths, self._images(image_ids))

    def score_ids(self, tokens: Tensor, lengths: Tensor,
                  image_ids: Sequence[Hashable]) -> Tensor:
        """(N,) float64 CIDEr-D of token ids (N, T): the first lengths[i] (no <end>) of row i,
        against image_ids[i]'s references; on the tokens' device. Needs `words`."""
        import torch

        if self._id_codes is None:
            raise ValueError("score_ids needs the model's words: CiderD(..., words=vocab.itos)")
        toks = tokens.detach().cpu().numpy()
        n_words = lengths.detach().cpu().numpy().astype(np.int64)  # (N,)
        if toks.shape[0] != len(image_ids) or n_words.shape != (toks.shape[0],):
            raise ValueError(f"tokens {tuple(toks.shape)}, lengths {tuple(n_words.shape)} and "
                             f"{len(image_ids)} image ids do not match")
        keep = np.arange(toks.shape[1]) < n_words[:, None]  # (N, T)
        codes = self._id_codes[toks[keep]]
        scores = self._score(codes, n_words, self._images(image_ids))
        return torch.from_numpy(scores).to(tokens.device)

    def _images(self, image_ids: Sequence[Hashable]) -> np.ndarray:
        try:
            return np.fromiter((self._index[i] for i in image_ids), np.int64, len(image_ids))
        except KeyError as e:
            raise ValueError(f"no references for image id {e.args[0]!r}") from None

    def _idf(self, df: np.ndarray, num_docs: int) -> np.ndarray:
        """log D - log max(1, df), as pycocoevalcap."""
        return math.log(float(num_docs)) - np.log(np.maximum(1.0, df))

    def _score(self, codes: np.ndarray, lengths: np.ndarray, images: np.ndarray) -> np.ndarray:
        """Scores of N candidates (flat codes, lengths (N,)) against images (N,)."""
        N, n, G = images.size, self.n, self._gram_keys.size
        if N == 0:
            return np.zeros(0)
        cand = count_ngrams(codes, lengths, n=n, bits=self._bits)
        at = np.searchsorted(self._gram_keys, cand.distinct).clip(max=max(G - 1, 0))
        found = self._gram_keys[at] == cand.distinct if G else np.zeros(at.size, dtype=bool)
        gid = np.where(found, at, -1)[cand.kid]  # (E,) n-gram id, -1: in no reference
        refs = self._batch_refs(images)
        df_of, num_docs = self._frequencies(refs, N)
        df_cand = np.zeros(gid.size)
        df_cand[gid >= 0] = df_of(gid[gid >= 0])  # n-grams in no reference: df 0
        v_cand = cand.tf * self._idf(df_cand, num_docs)  # (E,)
        v_ref = self._entry_tf[refs.entries] * self._idf(df_of(self._entry_gid[refs.entries]),
                                                          num_docs)  # (F,)
        U, R = refs.used.size, refs.width
        norm_ref = np.sqrt(np.bincount((refs.local * R + refs.slot) * n + refs.order, v_ref**2,
                                       minlength=U * R * n)).reshape(U, R, n)
        norm_cand = np.sqrt(np.bincount(cand.seq * n + cand.order, v_cand**2,
                                        minlength=N * n)).reshape(N, n)
        val = self._clipped_products(cand, gid, v_cand, images, refs, v_ref)  # (N, R, n)
        denom = norm_cand[:, None, :] * norm_ref[refs.inverse]  # (N, R, n)
        val = np.divide(val, denom, out=np.zeros_like(val), where=denom != 0)
        delta = cand.length[:, None] - refs.lengths[refs.inverse]  # (N, R)
        val *= np.exp(-(delta**2) / (2 * self.sigma**2))[:, :, None]
        num_refs = (self._ref_start[images + 1] - self._ref_start[images]).astype(np.float64)
        return val.sum(axis=1).mean(axis=1) / num_refs * 10.0

    def _batch_refs(self, images: np.ndarray) -> _BatchRefs:
        """The reference entries of the images of a batch (N,)."""
        used, inverse = np.unique(images, return_inverse=True)
        starts, stops = self._entry_start[used], self._entry_start[used + 1]
        entries = _ranges(starts, stops)
        local = np.repeat(np.arange(used.size), stops - starts)
        first_ref, end_ref = self._ref_start[used], self._ref_start[used + 1]
        width = int((end_ref - first_ref).max())
        ref = first_ref[:, None] + np.arange(width)  # (U, R)
        lengths = np.where(ref < end_ref[:, None],
                           self._ref_length[ref.clip(max=self._ref_length.size - 1)], 0.0)
        return _BatchRefs(used, inverse, np.bincount(inverse, minlength=used.size), entries,
                          local, self._entry_ref[entries] - first_ref[local],
                          self._entry_order[entries], width, lengths)

    def _frequencies(self, refs: _BatchRefs, rows: int
                     ) -> tuple[Callable[[np.ndarray], np.ndarray], int]:
        """(df of n-gram ids, D): the precomputed ones, or the batch's in corpus mode (one
        document per candidate row, so an image's n-grams count once per row of it)."""
        if self.df == "references":
            return (lambda gid: self._df[gid]), self._num_docs
        combos = self._combo[refs.entries]  # sorted: (image, n-gram) of the batch's images
        first = _first_of_runs(combos)
        gids, inv = np.unique(combos[first] % self._gram_keys.size, return_inverse=True)
        counts = np.bincount(inv, refs.rows[refs.local[first]].astype(np.float64))
        return (lambda gid: _lookup(gids, counts, gid)), rows

    def _clipped_products(self, cand: NGrams, gid: np.ndarray, v_cand: np.ndarray,
                          images: np.ndarray, refs: _BatchRefs, v_ref: np.ndarray
                          ) -> np.ndarray:
        """(N, R, n): Σ_g min(v_c(g), v_s(g)) v_s(g) over the n-grams each candidate shares
        with each reference slot of its image."""
        N, R, n, G = images.size, refs.width, self.n, self._gram_keys.size
        e = np.flatnonzero(gid >= 0)
        query = images[cand.seq[e]] * G + gid[e]
        combos = self._combo[refs.entries]
        lo = np.searchsorted(combos, query, side="left")
        hi = np.searchsorted(combos, query, side="right")
        e = np.repeat(e, hi - lo)  # one row per (candidate n-gram, reference holding it)
        f = _ranges(lo, hi)
        products = np.minimum(v_cand[e], v_ref[f]) * v_ref[f]
        index = (cand.seq[e] * R + refs.slot[f]) * n + cand.order[e]
        val = np.bincount(index, products, minlength=N * R * n)  # int64 when empty
        return val.astype(np.float64).reshape(N, R, n)


@dataclass
class _BatchRefs:
    """The reference entries of the images a batch scores (U images, F entries)."""

    used: np.ndarray  # (U,) image indices, sorted
    inverse: np.ndarray  # (N,) position of each row's image in `used`
    rows: np.ndarray  # (U,) candidate rows per image
    entries: np.ndarray  # (F,) entry indices, sorted by (image, n-gram)
    local: np.ndarray  # (F,) position of each entry's image in `used`
    slot: np.ndarray  # (F,) the entry's reference among its image's (0 .. R - 1)
    order: np.ndarray  # (F,) n-gram length - 1
    width: int  # R: the most references of one image
    lengths: np.ndarray  # (U, R) bigram count of each reference slot (0 past the last)
