"""Evaluation: tokens to words aligned with α, results per image, result files."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from captioning.evaluation import EvalResults, caption_words, to_results, write_results
from captioning.models.decoding import Generation
from captioning.vocab import Vocabulary

VOCAB = Vocabulary(["<pad>", "<start>", "<end>", "<unk>", "a", "red", "circle"])


def _generation() -> Generation:
    tokens = torch.tensor([[4, 3, 6, 2], [4, 5, 0, 0]])  # "a <unk> circle <end>", "a red"
    lengths = torch.tensor([4, 2])
    alphas = torch.arange(2 * 4 * 3, dtype=torch.float).view(2, 4, 3)
    return Generation(tokens, lengths, torch.tensor([-1.0, -2.0]), alphas,
                      torch.zeros(2, 4, dtype=torch.long), torch.tensor([True, False]))


def test_words_stay_aligned_with_steps_and_text_drops_specials() -> None:
    words, texts = caption_words(_generation(), VOCAB)
    assert words == [["a", "<unk>", "circle"], ["a", "red"]]
    assert texts == ["a circle", "a red"]


def test_results_keep_one_alpha_map_per_word(tmp_path: Path) -> None:
    gen = _generation()
    res = to_results(gen, VOCAB, ["x", "y"], [["a red circle"], ["a red square"]])
    assert res.hypotheses == {"x": "a circle", "y": "a red"}
    assert torch.equal(res.alphas["x"], gen.alphas[0, :3])  # <unk> keeps its map, <end> none
    assert res.alphas["y"].shape == (2, 3) and res.scores == {"x": -1.0, "y": -2.0}
    merged = EvalResults()
    merged.merge(res)
    merged.metrics = {"BLEU-4": 0.5}
    folder = write_results(merged, "test", tmp_path / "out")
    assert json.loads((folder / "test_captions.json").read_text()) == [
        {"image_id": "x", "caption": "a circle"}, {"image_id": "y", "caption": "a red"}]
    assert json.loads((folder / "test_metrics.json").read_text()) == {"BLEU-4": 0.5}
