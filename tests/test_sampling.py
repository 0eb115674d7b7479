"""Sampling and n-best beam search: limits, gradients, row layout, and the caption CLI flags."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from test_decoding import (
    END,
    PAD,
    START,
    D,
    L,
    MarkovDecoder,
    assert_well_formed,
    enumerate_sequences,
    hypothesis,
    make_decoder,
    markov_table,
    replay,
)

from captioning.checkpoint import save_inference_checkpoint
from captioning.commands.caption import main as caption_main
from captioning.models import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoding import (
    beam_search,
    greedy_search,
    length_normalised,
    sample_search,
)
from captioning.models.state import Memory
from captioning.vocab import SPECIALS, Vocabulary


# -- sampling -----------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sampling_at_near_zero_temperature_is_greedy(attention: str, seed: int) -> None:
    dec = make_decoder(seed, attention=attention, hard_decode="argmax")
    feats = torch.randn(5, L, D)
    g = greedy_search(dec, feats, max_len=8)
    s = sample_search(dec, feats, temperature=1e-5, max_len=8)
    assert_well_formed(s, 5, 8)
    assert torch.equal(g.tokens, s.tokens) and torch.equal(g.lengths, s.lengths)
    assert torch.equal(g.finished, s.finished) and torch.equal(g.locations, s.locations)
    torch.testing.assert_close(g.alphas, s.alphas)
    # log p renormalised over the words that may be emitted: a little above greedy's raw log p
    assert torch.all(s.scores >= g.scores - 1e-5) and torch.all(s.scores <= 0)


def test_k_samples_per_image_are_image_major_and_share_the_memory() -> None:
    dec = make_decoder(3)
    calls: list[int] = []
    memory = dec.memory

    def counted(features: torch.Tensor) -> Memory:
        calls.append(features.size(0))
        return memory(features)

    dec.memory = counted  # type: ignore[method-assign]
    feats = torch.randn(4, L, D)
    s = sample_search(dec, feats, num_samples=3, temperature=1e-5, max_len=7)
    assert calls == [4]  # one memory per image, shared by its 3 rows
    assert_well_formed(s, 12, 7)
    assert s.per_image == 3 and s.token_log_probs is not None
    assert s.token_log_probs.shape == s.tokens.shape
    g = greedy_search(dec, feats, max_len=7)
    for i in range(4):  # at T -> 0 every sample of image i is image i's greedy caption
        for r in range(3 * i, 3 * i + 3):
            assert hypothesis(s, r) == hypothesis(g, i)


def test_log_probs_are_those_of_the_drawn_words() -> None:
    dec = make_decoder(6)
    feats = torch.randn(3, L, D)
    gen = torch.Generator().manual_seed(0)
    s = sample_search(dec, feats, num_samples=4, temperature=1.5, max_len=6, generator=gen)
    assert_well_formed(s, 12, 6)
    assert s.token_log_probs is not None
    T = s.tokens.size(1)
    real = torch.arange(T) < s.lengths.unsqueeze(1)
    assert torch.all(s.token_log_probs[~real] == 0) and torch.all(s.token_log_probs[real] <= 0)
    torch.testing.assert_close(s.token_log_probs.sum(1), s.scores)
    for r in range(12):
        words = hypothesis(s, r)
        raw, _ = replay(dec, feats[r // 4 : r // 4 + 1], words)
        # renormalised over all but <pad>/<start>: log p - Σ_t log(1 - p(<pad>) - p(<start>))
        assert s.scores[r].item() == pytest.approx(raw - _banned_mass(dec, feats[r // 4], words),
                                                   abs=1e-4)
    again = sample_search(dec, feats, num_samples=4, temperature=1.5, max_len=6,
                          generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, s.tokens)  # a seeded generator repeats the draw
    assert len({tuple(hypothesis(s, r)) for r in range(12)}) > 3  # and T = 1.5 varies


@torch.no_grad()
def _banned_mass(dec: Any, features: torch.Tensor, words: list[int]) -> float:
    """Σ_t log(1 - p_t(<pad>) - p_t(<start>)) along `words`."""
    memory = dec.memory(features.unsqueeze(0))
    state = dec.init_state(memory)
    prev, total = START, 0.0
    for w in words:
        log_probs, state, _ = dec.step(torch.tensor([prev]), state, memory)
        p = log_probs[0].double().exp()
        total += math.log(1.0 - p[PAD].item() - p[START].item())
        prev = w
    return total


@pytest.mark.parametrize("temperature", [1.0, 2.0, 0.5])
def test_first_words_follow_softmax_over_temperature(temperature: float) -> None:
    dec = MarkovDecoder(markov_table())  # p(first word) = .50 <end>, .02 <unk>, .45 w4, .03 w5
    n = 20000
    s = sample_search(dec, torch.zeros(1, L, D), num_samples=n, temperature=temperature,
                      max_len=1, generator=torch.Generator().manual_seed(1))
    p = markov_table()[START]
    want = (p.log() / temperature).softmax(0)
    got = torch.bincount(s.tokens[:, 0], minlength=6).double() / n
    torch.testing.assert_close(got, want.double(), atol=4 * math.sqrt(0.25 / n), rtol=0)
    torch.testing.assert_close(s.scores, p.log()[s.tokens[:, 0]])  # log p at T = 1


def test_sampling_keeps_the_gradient_when_asked() -> None:
    dec = make_decoder(7).train()  # dropout off (make_decoder), grads on
    feats = torch.randn(3, L, D)
    s = sample_search(dec, feats, num_samples=2, max_len=6, grad=True)
    assert s.token_log_probs is not None and s.token_log_probs.requires_grad
    (-s.scores.sum()).backward()
    for name in ("embed.weight", "lstm.weight_hh", "out.weight", "init_h.weight"):
        grad = dict(dec.named_parameters())[name].grad
        assert grad is not None and grad.abs().sum() > 0, name
    plain = sample_search(dec, feats, max_len=6)  # no graph unless asked
    assert not plain.scores.requires_grad and not plain.token_log_probs.requires_grad
    with torch.inference_mode():
        assert sample_search(dec, feats, max_len=6, grad=True).tokens.size(0) == 3


def test_sampling_arguments_are_checked() -> None:
    dec = make_decoder(0)
    with pytest.raises(ValueError, match="temperature"):
        sample_search(dec, torch.randn(1, L, D), temperature=0.0)
    with pytest.raises(ValueError, match="num_samples"):
        sample_search(dec, torch.randn(1, L, D), num_samples=0)


# -- n-best -------------------------------------------------------------------------------------
@pytest.mark.parametrize("length_penalty", [0.0, 0.7])
@pytest.mark.parametrize(("beam_size", "n"), [(3, 2), (3, 3), (5, 4)])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_n_best_first_caption_is_the_single_best(attention: str, beam_size: int, n: int,
                                                 length_penalty: float) -> None:
    dec = make_decoder(8, attention=attention)
    feats = torch.randn(6, L, D)
    one = beam_search(dec, feats, beam_size=beam_size, max_len=9, length_penalty=length_penalty)
    many = beam_search(dec, feats, beam_size=beam_size, max_len=9,
                       length_penalty=length_penalty, num_captions=n)
    assert_well_formed(many, 6 * n, 9)
    assert many.per_image == n and one.per_image == 1
    for i in range(6):
        rows = range(i * n, i * n + n)
        assert hypothesis(many, i * n) == hypothesis(one, i)
        torch.testing.assert_close(many.scores[i * n], one.scores[i])
        assert len({tuple(hypothesis(many, r)) for r in rows}) == n  # distinct hypotheses
        norm = length_normalised(many.scores[i * n : i * n + n],
                                 many.lengths[i * n : i * n + n], length_penalty)
        done = many.finished[i * n : i * n + n]
        assert torch.all(norm[done][:-1] >= norm[done][1:])  # best first
        assert not torch.any(done[1:] & ~done[:-1])  # finished ones before the others
        for r in rows:  # each score is that of its words
            score, _ = replay(dec, feats[i : i + 1], hypothesis(many, r))
            assert many.scores[r].item() == pytest.approx(score, abs=1e-5)


@pytest.mark.parametrize("length_penalty", [0.0, 1.0])
def test_wide_n_best_is_the_enumerated_top_n(length_penalty: float) -> None:
    dec = make_decoder(11, vocab_size=6)  # V = 6, max_len 4: 40 sequences, 108 candidates
    feats = torch.randn(1, L, D)
    finished, _ = enumerate_sequences(dec, feats, max_len=4, words=[3, 4, 5])
    scores = torch.tensor([s for _, s in finished], dtype=torch.float64)
    norm = length_normalised(scores, torch.tensor([len(t) for t, _ in finished]), length_penalty)
    top = torch.argsort(norm, descending=True)[:5]
    assert (norm[top[:-1]] - norm[top[1:]]).min() > 1e-4  # no near-ties
    gen = beam_search(dec, feats, beam_size=108, max_len=4, length_penalty=length_penalty,
                      num_captions=5)
    assert [tuple(hypothesis(gen, r)) for r in range(5)] == [finished[i][0] for i in top]
    assert bool(gen.finished.all())


def test_n_best_without_finished_hypotheses_returns_live_beams() -> None:
    dec = make_decoder(20, vocab_size=6)
    with torch.no_grad():
        dec.out.bias[END] = float("-inf")
    gen = beam_search(dec, torch.randn(2, L, D), beam_size=4, max_len=4, num_captions=3)
    assert_well_formed(gen, 6, 4)
    assert not gen.finished.any() and torch.all(gen.lengths == 4)
    scores = gen.scores.view(2, 3)
    assert torch.all(scores[:, :-1] >= scores[:, 1:])
    with pytest.raises(ValueError, match="num_captions"):
        beam_search(dec, torch.randn(1, L, D), beam_size=2, num_captions=3)


# -- configuration and Captioner.generate ---------------------------------------------------------
def tiny_captioner(vocab_size: int, seed: int = 0) -> Captioner:
    torch.manual_seed(seed)
    return Captioner(CaptionerConfig(vocab_size=vocab_size, backbone="resnet18", grid_size=2,
                                     image_size=64, embed_dim=16, hidden_dim=16, attn_dim=16,
                                     dropout=0.0)).eval()


def test_decode_config_and_generate_dispatch() -> None:
    for bad, match in (({"temperature": 0.0}, "temperature"),
                       ({"strategy": "beam", "beam_size": 2, "num_captions": 3}, "num_captions"),
                       ({"strategy": "greedy", "num_captions": 2}, "num_captions"),
                       ({"num_captions": 0}, "num_captions"),
                       ({"strategy": "topk"}, "strategy")):
        with pytest.raises(ValueError, match=match):
            DecodeConfig(**bad)
    cfg = DecodeConfig(strategy="sample", temperature=0.7, num_captions=4)
    assert DecodeConfig.from_dict(cfg.to_dict()) == cfg
    assert DecodeConfig.from_dict({"strategy": "beam"}).num_captions == 1  # older dicts
    model = tiny_captioner(12)
    feats = torch.randn(2, 4, 512)
    gen = model.generate(feats, cfg)
    assert gen.tokens.size(0) == 8 and gen.per_image == 4 and gen.token_log_probs is not None
    gen = model.generate(feats, DecodeConfig(beam_size=3, num_captions=2, max_len=5))
    assert gen.tokens.size(0) == 4 and gen.per_image == 2
    gen = model.generate(feats, DecodeConfig(strategy="sample", max_len=5), grad=True)
    assert gen.scores.requires_grad
    with pytest.raises(ValueError, match="sample"):
        model.generate(feats, DecodeConfig(), grad=True)


# -- the caption command ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """An untrained tiny checkpoint whose captions are several words long, and three images."""
    tmp = tmp_path_factory.mktemp("sampling_cli")
    vocab = Vocabulary([*SPECIALS, "a", "red", "blue", "circle", "square", "left", "of"])
    model = tiny_captioner(len(vocab), seed=3)
    with torch.no_grad():
        model.decoder.out.bias[END] = -2.0  # a few words before <end>
    decode = DecodeConfig(beam_size=3, max_len=6)
    path = save_inference_checkpoint(tmp / "tiny.pt", model, vocab, decode=decode)
    images = []
    for i, colour in enumerate([(200, 30, 30), (30, 30, 200), (30, 160, 30)]):
        images.append(tmp / f"img{i}.png")
        Image.new("RGB", (64, 64), colour).save(images[-1])
    return {"path": path, "images": images, "model": model, "vocab": vocab, "decode": decode}


def run_caption(capsys: pytest.CaptureFixture[str], *args: Any) -> list[dict[str, Any]]:
    assert caption_main([str(a) for a in args]) == 0
    return [json.loads(ln) for ln in capsys.readouterr().out.splitlines()]


def expected(ckpt: dict[str, Any], decode: DecodeConfig) -> list[str]:
    """Captions of the checkpoint's images, loaded as the command loads them."""
    from captioning.data.images import load_image
    from captioning.data.transforms import build_image_transform

    transform = build_image_transform(64)
    images = torch.stack([transform(load_image(p, min_side=64)) for p in ckpt["images"]])
    model, vocab = ckpt["model"], ckpt["vocab"]
    with torch.no_grad():
        gen = model.generate(images, decode)
    return [" ".join(vocab.decode(row[:n]))
            for row, n in zip(gen.tokens.tolist(), gen.lengths.tolist())]


def test_caption_num_captions(checkpoint: dict[str, Any], capsys) -> None:
    records = run_caption(capsys, "--checkpoint", checkpoint["path"], "--json",
                          "--num-captions", 3, *checkpoint["images"])
    want = expected(checkpoint, DecodeConfig(beam_size=3, max_len=6, num_captions=3))
    assert len(records) == 3
    for i, rec in enumerate(records):
        caps = rec["captions"]
        assert [c["caption"] for c in caps] == want[3 * i : 3 * i + 3]
        assert rec["caption"] == caps[0]["caption"]  # the best one, as without the flag
        assert all(c["score"] <= 0 for c in caps)
    single = run_caption(capsys, "--checkpoint", checkpoint["path"], "--json",
                         *checkpoint["images"])
    assert [r["caption"] for r in single] == [r["caption"] for r in records]
    assert all("captions" not in r for r in single)  # one caption: today's records
    assert caption_main(["--checkpoint", str(checkpoint["path"]), "--num-captions", "4",
                         str(checkpoint["images"][0])]) == 2  # more than the beam
    assert "num-captions" in capsys.readouterr().err


def test_caption_sample(checkpoint: dict[str, Any], capsys) -> None:
    records = run_caption(capsys, "--checkpoint", checkpoint["path"], "--json", "--sample",
                          "--temperature", 1e-5, *checkpoint["images"])
    assert [r["caption"] for r in records] == expected(
        checkpoint, DecodeConfig(strategy="greedy", max_len=6))
    records = run_caption(capsys, "--checkpoint", checkpoint["path"], "--json", "--sample",
                          "--num-captions", 5, *checkpoint["images"])
    assert [len(r["captions"]) for r in records] == [5, 5, 5]
    assert all(c["score"] <= 0 for r in records for c in r["captions"])
    assert caption_main(["--checkpoint", str(checkpoint["path"]), "--temperature", "0",
                         "--sample", str(checkpoint["images"][0])]) == 2
    assert "temperature" in capsys.readouterr().err


def test_caption_text_output_with_several_captions(checkpoint: dict[str, Any], capsys) -> None:
    assert caption_main(["--checkpoint", str(checkpoint["path"]), "--num-captions", "2",
                         *map(str, checkpoint["images"])]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 6  # path<TAB>caption per caption, best first
    assert [ln.split("\t")[0] for ln in lines] == [str(p) for p in checkpoint["images"]
                                                   for _ in range(2)]
    assert Path(lines[0].split("\t")[0]).exists()
    # Best first: the beam's 2 best captions of each image in its order, the higher score first
    # (the checkpoint ranks by the raw log-probability: length_penalty 0).
    assert checkpoint["decode"].length_penalty == 0.0
    records = run_caption(capsys, "--checkpoint", checkpoint["path"], "--json",
                          "--num-captions", 2, *checkpoint["images"])
    texts = [ln.split("\t")[1] for ln in lines]
    assert texts == [c["caption"] for r in records for c in r["captions"]]
    assert texts == expected(checkpoint, DecodeConfig(beam_size=3, max_len=6, num_captions=2))
    for rec in records:
        (best, second) = rec["captions"]
        assert best["caption"] != second["caption"] and best["score"] > second["score"]
