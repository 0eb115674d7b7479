"""Evaluation: the results of a pass, tokens to words and α maps, metrics and result files.

`caption_words` is the one place where decoded token ids become words aligned with their
attention maps; the LightningModule, the overlay callback and the `caption` command all use it.
(The text alone is `Vocabulary.decode`'s, which `Captioner.captions` calls too.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch import Tensor

from captioning.atomic import write_json_atomic
from captioning.distributed import all_gather_objects, is_distributed
from captioning.locks import sigterm_raises
from captioning.models.decoding import Generation
from captioning.run_folder import aside_path, next_aside
from captioning.vocab import Vocabulary

if TYPE_CHECKING:  # the data sources' object boxes (captioning.data.sources)
    from captioning.data.sources import ObjectBoxes

log = logging.getLogger(__name__)


@dataclass
class EvalResults:
    """Decoded captions of one evaluation pass, keyed by image id."""

    hypotheses: dict[Any, str] = field(default_factory=dict)
    references: dict[Any, list[str]] = field(default_factory=dict)
    words: dict[Any, list[str]] = field(default_factory=dict)
    alphas: dict[Any, Tensor] = field(default_factory=dict)  # (T, L) on the CPU
    scores: dict[Any, float] = field(default_factory=dict)
    cider: dict[Any, float] = field(default_factory=dict)  # per image, set by compute_metrics
    metrics: dict[str, float] = field(default_factory=dict)

    def merge(self, other: EvalResults) -> None:
        for name in ("hypotheses", "references", "words", "alphas", "scores", "cider"):
            getattr(self, name).update(getattr(other, name))


def caption_words(gen: Generation, vocab: Vocabulary) -> tuple[list[list[str]], list[str]]:
    """Per decoded caption: its words position-aligned with the decoding steps (so word t is
    drawn over α_t; a special token such as <unk> keeps its step, the final <end> is dropped),
    and its text with every special token removed (what the metrics score)."""
    words, texts = [], []
    for row, n in zip(gen.tokens.tolist(), gen.lengths.tolist()):
        ids = row[:n]
        words.append([vocab.itos[t] for t in ids if t != vocab.end_id])
        texts.append(" ".join(vocab.decode(ids)))
    return words, texts


def ranked_captions(texts: list[str], scores: list[float], k: int) -> list[list[dict[str, Any]]]:
    """Each image's k captions as `{"caption", "score"}`, best first for beams: rows i·k ..
    i·k + k - 1 of a `Generation` with k captions an image (`caption` and `predict` output)."""
    if len(texts) != len(scores) or len(texts) % k:
        raise ValueError(f"{len(texts)} captions and {len(scores)} scores are not {k} an image")
    return [[{"caption": texts[r], "score": scores[r]} for r in range(k * i, k * i + k)]
            for i in range(len(texts) // k)]


def predictions(gen: Generation, vocab: Vocabulary) -> dict[str, Any]:
    """Each image's first caption (its best beam, or first sample): `words`, `captions`,
    `scores` and its `generation` (α maps); with k > 1 captions an image, all k as
    `alternatives` (`ranked_captions`). What `captioning predict` writes."""
    k = gen.per_image  # rows i·k .. i·k + k - 1 are image i's, best first for beams
    words, texts = caption_words(gen, vocab)
    scores = gen.scores.tolist()
    out = {"words": words[::k], "captions": texts[::k], "scores": scores[::k],
           "generation": gen.first_per_image()}
    if k > 1:
        out["alternatives"] = ranked_captions(texts, scores, k)
    return out


def to_results(gen: Generation, vocab: Vocabulary, image_ids: list[Any],
               references: list[list[str]] | None = None) -> EvalResults:
    """Decoded words, captions, α maps and scores per image id (one decoded row per image)."""
    if gen.tokens.size(0) != len(image_ids):
        raise ValueError(f"{gen.tokens.size(0)} decoded rows for {len(image_ids)} images: pass "
                         "one caption per image (Generation.first_per_image)")
    res = EvalResults()
    words, texts = caption_words(gen, vocab)
    alphas = gen.alphas.float().cpu()
    for i, image_id in enumerate(image_ids):
        res.words[image_id] = words[i]
        res.hypotheses[image_id] = texts[i]
        res.alphas[image_id] = alphas[i, : len(words[i])]
        res.scores[image_id] = float(gen.scores[i])
        if references is not None:
            res.references[image_id] = list(references[i])
    return res


def gather(results: EvalResults) -> EvalResults:
    """Every rank's captions, each image once (DDP samplers may pad with repeats)."""
    if not is_distributed():
        return results
    merged = EvalResults()
    for p in all_gather_objects(results):
        merged.merge(p)
    return merged


def compute_metrics(results: EvalResults, *, grid: tuple[int, int],
                    grounding: ObjectBoxes | None = None, image_size: int | None = None,
                    spice: bool = False) -> dict[str, float]:
    """coco-caption scores (with SPICE when `spice` and it can run), plus objects correct and
    pointing accuracy when the data source has object boxes (`grounding`). Also fills
    `results.cider` (each image's CIDEr-D)."""
    from captioning.metrics import coco_scores, objects_correct
    from captioning.pointing import pointing_accuracy

    with sigterm_raises():  # scoring runs Java for a while: SIGTERM stops it, not after it
        metrics = coco_scores(results.references, results.hypotheses, spice=spice,
                              per_image_cider=results.cider)
    if grounding is None:
        return metrics
    ids = [i for i in results.hypotheses if i in grounding]
    if not ids:
        return metrics
    metrics["objects_correct"] = objects_correct(
        {i: results.hypotheses[i] for i in ids}, {i: grounding.objects(i) for i in ids},
        parse=grounding.parse)
    if image_size is not None:
        acc, _, scored = pointing_accuracy(
            [results.words[i] for i in ids], [results.alphas[i] for i in ids], grid,
            grounding.crop_boxes(ids, image_size), object_words=grounding.object_words,
            color_words=grounding.color_words, modifier_words=grounding.modifier_words)
        if scored:
            metrics["pointing_accuracy"] = acc
    return metrics


def results_files(folder: str | Path, split: str) -> tuple[Path, Path]:
    """(the COCO captions file, the metrics file) of a `split` pass in `folder`:
    `{split}_captions.json` and `{split}_metrics.json`."""
    return Path(folder) / f"{split}_captions.json", Path(folder) / f"{split}_metrics.json"


def write_results(results: EvalResults, split: str, folder: str | Path) -> Path:
    """COCO results file [{"image_id", "caption"}] and a metrics JSON, each written atomically;
    returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    captions, metrics = results_files(folder, split)
    write_json_atomic(captions, [{"image_id": i, "caption": c}
                                 for i, c in results.hypotheses.items()])
    write_json_atomic(metrics, results.metrics, indent=2)
    log.info("wrote %s and %s", captions, metrics)
    return folder


def set_aside_results(folder: str | Path, split: str, rank_zero: bool = True) -> list[Path]:
    """Rename an earlier run's `{split}_captions.json` / `{split}_metrics.json` in `folder`
    before a new pass, so that files beside a run are its own (a killed pass leaves none) and
    nothing is lost: to `{split}_*.previous.json`, or where earlier passes were set aside
    already, `.previous-2.json`, `-3`, ... (one past the highest number taken by either file,
    so a pass's two files keep one number; the higher, the later). Returns the new paths."""
    present = [old for old in results_files(folder, split) if old.is_file()]
    if not rank_zero or not present:
        return []
    n = next_aside(results_files(folder, split), ".json")  # one number for both files
    moved = [old.replace(aside_path(old, n, ".json")) for old in present]
    log.info("moved the previous %s results aside: %s", split, ", ".join(map(str, moved)))
    return moved

