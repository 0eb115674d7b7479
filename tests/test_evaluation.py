"""Evaluation: tokens to words aligned with α, results per image, result files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

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


def test_spice_is_asked_for_in_the_test_pass_only(shapes_dm_kwargs: dict, tmp_path: Path,
                                                  tiny_fit: Any, monkeypatch: Any) -> None:
    """`spice: true` scores SPICE in the test pass, not at every validation (SPICE takes
    minutes on COCO); off by default. (Where SPICE cannot run, `coco_scores` warns why and
    returns the other metrics: tests/test_metrics.py.)"""
    import captioning.metrics as metrics
    from captioning.data.datamodule import CaptionDataModule
    from captioning.lit_module import CaptioningModule
    from captioning.models.captioner import CaptionerConfig, DecodeConfig

    asked: list[bool] = []

    def spy(references: Any, hypotheses: Any, *, spice: bool = False, **kw: Any) -> dict:
        asked.append(spice)
        return {"BLEU-4": 0.0}

    monkeypatch.setattr(metrics, "coco_scores", spy)
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "feature_cache": False})
    net = CaptionerConfig(backbone="resnet18", weights=None, grid_size=2, image_size=64,
                          embed_dim=8, hidden_dim=8, attn_dim=8)
    decode = DecodeConfig(strategy="greedy", max_len=4)
    for spice, expected in ((True, [False, True]), (False, [False, False])):
        asked.clear()
        module = CaptioningModule(vocab_size=dm.vocab_size, net=net, decode=decode, spice=spice)
        tiny_fit(dm, module, tmp_path, train_batches=1).test(module, datamodule=dm)
        assert asked == expected
        assert json.loads((tmp_path / "test_metrics.json").read_text())["BLEU-4"] == 0.0
