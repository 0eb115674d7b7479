"""Time the vectorised CIDEr-D reward (captioning.cider) on SCST-sized batches.

    python scripts/bench_cider.py [--images 20000] [--batch 50] [--samples 5] [--max-len 16]
                                  [--repeats 50] [--compare]

References are synthetic but COCO-shaped: `--images` training images with 5 references of
8-16 words each, drawn from a Zipf-like vocabulary of `--vocab` words; document frequencies come
from them once. A batch is `--batch` images × `--samples` sampled captions of random token ids
(lengths 1..`--max-len`), scored with `CiderD.score_ids`. For scale it also times one
`decoder.step` of a demo-size decoder (embed 128, hidden 192, attention 96 over an 8×8 grid of
96 channels) on the same B·k rows, and with --compare pycocoevalcap's CiderScorer (pure Python)
on the same batch (its document frequencies are the same counts; its log D is that of the
batch's rows, not of `--images`).
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable

import numpy as np
import torch

from captioning.cider import CiderD
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.vocab import SPECIALS

log = logging.getLogger("bench_cider")


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    """Median wall time of fn() in milliseconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def synthetic_references(args: argparse.Namespace, rng: np.random.Generator
                         ) -> tuple[dict[int, list[list[str]]], list[str]]:
    """COCO-shaped references with Zipf-like word frequencies, and the model's word list."""
    words = [f"w{i}" for i in range(args.vocab)]
    p = 1.0 / np.arange(1, args.vocab + 1)
    p /= p.sum()
    refs = {}
    for image in range(args.images):
        lengths = rng.integers(8, 17, size=5)
        refs[image] = [[words[j] for j in rng.choice(args.vocab, size=n, p=p)] for n in lengths]
    return refs, [*SPECIALS, *words]


def decoder_step_ms(rows: int, vocab: int, repeats: int) -> float:
    """One decoder.step of the demo-size decoder over `rows` captions, under no_grad."""
    torch.manual_seed(0)
    decoder = AttentionLSTMDecoder(vocab_size=vocab, feature_dim=96, embed_dim=128,
                                   hidden_dim=192, attn_dim=96, dropout=0.0).eval()
    features = torch.randn(rows, 64, 96).relu()
    with torch.no_grad():
        memory = decoder.memory(features)
        state = decoder.init_state(memory)
        tokens = torch.randint(4, vocab, (rows,))
        return median_ms(lambda: decoder.step(tokens, state, memory), repeats)


def pycocoevalcap_ms(cider_refs: dict[int, list[list[str]]], cands: list[list[str]],
                     rows: list[int], repeats: int) -> float:
    """pycocoevalcap's CiderScorer on the batch, its df taken from the training references."""
    from collections import defaultdict

    from pycocoevalcap.cider.cider_scorer import CiderScorer

    full = CiderScorer(n=4, sigma=6.0)
    for refs in cider_refs.values():
        full += ("", [" ".join(r) for r in refs])
    full.compute_doc_freq()
    df = full.document_frequency

    def run() -> None:
        scorer = CiderScorer(n=4, sigma=6.0)
        for cand, image in zip(cands, rows):
            scorer += (" ".join(cand), [" ".join(r) for r in cider_refs[image]])
        scorer.document_frequency = defaultdict(float, df)
        scorer.compute_cider()  # D = rows here, not the training images: timing only

    return median_ms(run, max(1, repeats // 10))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=20000, help="training images (5 refs each)")
    p.add_argument("--vocab", type=int, default=10000)
    p.add_argument("--batch", type=int, default=50, help="images per batch")
    p.add_argument("--samples", type=int, default=5, help="sampled captions per image")
    p.add_argument("--max-len", type=int, default=16)
    p.add_argument("--repeats", type=int, default=50)
    p.add_argument("--threads", type=int, default=1, help="torch threads for the decoder step")
    p.add_argument("--compare", action="store_true", help="also time pycocoevalcap")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    refs, words = synthetic_references(args, rng)
    start = time.perf_counter()
    cider = CiderD(refs, words=words)
    log.info("CiderD over %d images × 5 references: built in %.2f s", args.images,
             time.perf_counter() - start)
    rows_n = args.batch * args.samples
    images = np.repeat(rng.choice(args.images, size=args.batch, replace=False), args.samples)
    image_ids = images.tolist()
    tokens = torch.randint(len(SPECIALS), len(words), (rows_n, args.max_len))
    lengths = torch.randint(1, args.max_len + 1, (rows_n,))
    reward = median_ms(lambda: cider.score_ids(tokens, lengths, image_ids), args.repeats)
    step = decoder_step_ms(rows_n, len(words), args.repeats)
    log.info("reward: %.2f ms per batch of %d images × %d samples (length <= %d)",
             reward, args.batch, args.samples, args.max_len)
    log.info("decoder.step (demo size, %d rows, V = %d): %.2f ms; a %d-word sampled caption "
             "takes %d steps", rows_n, len(words), step, args.max_len, args.max_len)
    if args.compare:
        cands = [[words[t] for t in row[:n]] for row, n in zip(tokens.tolist(), lengths.tolist())]
        slow = pycocoevalcap_ms(refs, cands, image_ids, args.repeats)
        log.info("pycocoevalcap CiderScorer: %.1f ms per batch (%.0f× slower)", slow,
                 slow / reward)


if __name__ == "__main__":
    main()
