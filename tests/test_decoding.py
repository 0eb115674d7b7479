"""Greedy and beam search: equivalences, exactness against enumeration, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from torch import Tensor

from captioning.models import AttentionLSTMDecoder, Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoding import Generation, beam_search, greedy_search, length_normalised
from captioning.models.state import DecoderState, Memory

PAD, START, END, UNK = 0, 1, 2, 3
D, L = 16, 5


def make_decoder(seed: int, *, vocab_size: int = 10, **kw) -> AttentionLSTMDecoder:
    torch.manual_seed(seed)
    args = dict(vocab_size=vocab_size, feature_dim=D, embed_dim=16, hidden_dim=16, attn_dim=16,
                dropout=0.0)
    args.update(kw)
    dec = AttentionLSTMDecoder(**args).eval()
    with torch.no_grad():  # sharper, more varied word distributions than the default init
        dec.out.weight.mul_(4.0)
        dec.out.bias.copy_(torch.randn(vocab_size))
    return dec


@torch.no_grad()
def replay(dec, features: Tensor, tokens: list[int]) -> tuple[float, Tensor]:
    """Σ log p of `tokens` after <start>, and the α of each step, by calling decoder.step."""
    memory = dec.memory(features)
    state = dec.init_state(memory)
    prev, total, alphas = START, 0.0, []
    for w in tokens:
        log_probs, state, alpha = dec.step(torch.tensor([prev]), state, memory)
        total += log_probs[0, w].item()
        alphas.append(alpha[0])
        prev = w
    return total, torch.stack(alphas)


@torch.no_grad()
def enumerate_sequences(dec, features: Tensor, *, max_len: int, words: list[int]
                        ) -> tuple[list[tuple[tuple[int, ...], float]], list[tuple[tuple[int, ...], float]]]:
    """All (finished, unfinished) sequences with raw log-probabilities, via decoder.step.

    A sequence emits words from `words` (never <pad>/<start>, as the search) and ends at <end>
    (finished) or after max_len tokens (unfinished).
    """
    memory = dec.memory(features)
    finished, unfinished = [], []
    frontier = [((), 0.0, dec.init_state(memory), START)]
    for t in range(max_len):
        nxt = []
        for toks, score, state, prev in frontier:
            log_probs, new_state, _ = dec.step(torch.tensor([prev]), state, memory)
            lp = log_probs[0].double()
            finished.append(((*toks, END), score + lp[END].item()))
            for w in words:
                seq = ((*toks, w), score + lp[w].item())
                if t + 1 < max_len:
                    nxt.append((*seq, new_state, w))
                else:
                    unfinished.append(seq)
        frontier = nxt
    return finished, unfinished


def best_by_normalised(seqs: list[tuple[tuple[int, ...], float]], length_penalty: float
                       ) -> tuple[tuple[int, ...], float]:
    scores = torch.tensor([s for _, s in seqs], dtype=torch.float64)
    lengths = torch.tensor([len(t) for t, _ in seqs])
    norm = length_normalised(scores, lengths, length_penalty)
    order = torch.argsort(norm, descending=True)
    top, second = norm[order[0]].item(), norm[order[1]].item()
    assert top - second > 1e-4, "near-tie: pick another seed"
    return seqs[int(order[0])]


def hypothesis(gen: Generation, i: int) -> list[int]:
    return gen.tokens[i, : int(gen.lengths[i])].tolist()


def assert_well_formed(gen: Generation, n: int, max_len: int) -> None:
    """Integer ids, <pad> after the end, α rows that sum to 1 and vanish past the length."""
    for t in (gen.tokens, gen.lengths, gen.locations):
        assert t.dtype == torch.long
    assert gen.finished.dtype == torch.bool
    T = gen.tokens.size(1)
    assert gen.tokens.shape == (n, T) and gen.alphas.shape == (n, T, L)
    assert gen.locations.shape == (n, T) and gen.scores.shape == (n,)
    assert T == int(gen.lengths.max()) <= max_len
    real = torch.arange(T).unsqueeze(0) < gen.lengths.unsqueeze(1)  # (n, T)
    assert torch.all(gen.tokens[~real] == PAD)
    assert not torch.any((gen.tokens == PAD)[real] | (gen.tokens == START)[real])
    torch.testing.assert_close(gen.alphas.sum(-1)[real], torch.ones(int(real.sum())))
    assert torch.all(gen.alphas[~real] == 0) and torch.all(gen.locations[~real] == 0)
    for i in range(n):
        toks = hypothesis(gen, i)
        assert (toks[-1] == END) == bool(gen.finished[i])
        assert END not in toks[:-1]
        if not gen.finished[i]:
            assert len(toks) == max_len


# -- equivalences -------------------------------------------------------------------------------
@pytest.mark.parametrize("attention", ["soft", "hard"])
@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_beam_of_one_is_greedy(attention: str, seed: int) -> None:
    dec = make_decoder(seed, attention=attention, hard_decode="expected")
    feats = torch.randn(6, L, D)
    g = greedy_search(dec, feats, max_len=8)
    b = beam_search(dec, feats, beam_size=1, max_len=8)
    assert_well_formed(g, 6, 8)
    assert_well_formed(b, 6, 8)
    assert torch.equal(g.tokens, b.tokens) and torch.equal(g.lengths, b.lengths)
    assert torch.equal(g.finished, b.finished)
    torch.testing.assert_close(g.scores, b.scores, atol=1e-5, rtol=0)
    torch.testing.assert_close(g.alphas, b.alphas)
    assert torch.equal(g.locations, b.locations)


@pytest.mark.parametrize("length_penalty", [0.0, 0.8])
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_batched_beam_equals_one_image_at_a_time(attention: str, length_penalty: float) -> None:
    dec = make_decoder(4, attention=attention)
    feats = torch.randn(5, L, D)
    batch = beam_search(dec, feats, beam_size=4, max_len=9, length_penalty=length_penalty)
    assert_well_formed(batch, 5, 9)
    for i in range(5):
        one = beam_search(dec, feats[i : i + 1], beam_size=4, max_len=9,
                          length_penalty=length_penalty)
        n = int(one.lengths[0])
        assert hypothesis(batch, i) == hypothesis(one, 0)
        assert bool(batch.finished[i]) == bool(one.finished[0])
        torch.testing.assert_close(batch.scores[i], one.scores[0], atol=1e-5, rtol=0)
        torch.testing.assert_close(batch.alphas[i, :n], one.alphas[0, :n], atol=1e-5, rtol=0)
        assert torch.equal(batch.locations[i, :n], one.locations[0, :n])


def test_scores_and_alphas_are_those_of_the_emitted_words() -> None:
    dec = make_decoder(5)
    feats = torch.randn(4, L, D)
    for gen in (greedy_search(dec, feats, max_len=7),
                beam_search(dec, feats, beam_size=3, max_len=7, length_penalty=0.5)):
        for i in range(4):
            score, alphas = replay(dec, feats[i : i + 1], hypothesis(gen, i))
            assert gen.scores[i].item() == pytest.approx(score, abs=1e-5)
            torch.testing.assert_close(gen.alphas[i, : alphas.size(0)], alphas, atol=1e-5, rtol=0)
            torch.testing.assert_close(gen.locations[i, : alphas.size(0)], alphas.argmax(-1))


# -- exactness ----------------------------------------------------------------------------------
# V = 6: <pad> <start> <end> <unk> + 2 words. With max_len 4 the search can emit <end>, <unk>, 4, 5:
# 1 + 3 + 9 + 27 = 40 finished sequences. At step t there are 3^t live prefixes with 4 choices
# each, at most 4·27 = 108 candidates, so a beam of 108 keeps every candidate: the search is then
# exhaustive and must return exactly the enumerated optimum (this also exercises the early stop,
# whose bound has to be a true upper bound for the result to stay exact).
@pytest.mark.parametrize("forbid_unk", [False, True])
@pytest.mark.parametrize("length_penalty", [0.0, 0.7, 1.5])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_wide_beam_matches_exhaustive_enumeration(seed: int, length_penalty: float,
                                                  forbid_unk: bool) -> None:
    dec = make_decoder(10 + seed, vocab_size=6)
    feats = torch.randn(1, L, D)
    words = [4, 5] if forbid_unk else [UNK, 4, 5]
    finished, _ = enumerate_sequences(dec, feats, max_len=4, words=words)
    assert len(finished) == sum(len(words) ** t for t in range(4))
    best, best_score = best_by_normalised(finished, length_penalty)
    gen = beam_search(dec, feats, beam_size=108, max_len=4, length_penalty=length_penalty,
                      forbid_unk=forbid_unk)
    assert bool(gen.finished[0])
    assert tuple(hypothesis(gen, 0)) == best
    assert gen.scores[0].item() == pytest.approx(best_score, abs=1e-5)


def test_exhaustive_optima_are_varied() -> None:
    """The exactness test is not trivially about one-word captions: optima of several lengths."""
    lengths = set()
    for seed in range(3):
        dec = make_decoder(10 + seed, vocab_size=6)
        feats = torch.randn(1, L, D)
        finished, _ = enumerate_sequences(dec, feats, max_len=4, words=[UNK, 4, 5])
        for lp in (0.0, 0.7, 1.5):
            lengths.add(len(best_by_normalised(finished, lp)[0]))
    assert len(lengths) >= 2


# -- no <end> ever -------------------------------------------------------------------------------
@pytest.mark.parametrize(("end_bias", "beam_size"), [(-1e9, 3), (float("-inf"), 27)])
def test_no_finished_hypothesis_falls_back_to_the_best_live_one(end_bias: float,
                                                                beam_size: int) -> None:
    dec = make_decoder(20, vocab_size=6)
    with torch.no_grad():
        dec.out.bias[END] = end_bias
    feats = torch.randn(2, L, D)
    for gen in (greedy_search(dec, feats, max_len=4),
                beam_search(dec, feats, beam_size=beam_size, max_len=4)):
        assert_well_formed(gen, 2, 4)
        assert not gen.finished.any()
        assert torch.all(gen.lengths == 4) and not torch.any(gen.tokens == END)
        assert torch.isfinite(gen.scores).all()
    # With 27 beams every length-4 sequence is kept (3 words per step, 3^3 = 27 prefixes), so the
    # fallback must be the best unfinished sequence of all.
    if beam_size == 27:
        for i in range(2):
            _, unfinished = enumerate_sequences(dec, feats[i : i + 1], max_len=4,
                                                words=[UNK, 4, 5])
            best, score = max(unfinished, key=lambda s: s[1])
            assert tuple(hypothesis(gen, i)) == best
            assert gen.scores[i].item() == pytest.approx(score, abs=1e-4)


# -- length penalty -----------------------------------------------------------------------------
class MarkovDecoder:
    """A scripted step decoder: p(y_t | y_{t-1}) from a fixed table; uniform α."""

    def __init__(self, table: Tensor) -> None:
        self.table = table.log()  # (V, V) probabilities by previous token

    def memory(self, features: Tensor) -> Memory:
        return Memory(features, features)

    def init_state(self, memory: Memory) -> DecoderState:
        B = memory.values.size(0)
        return DecoderState(torch.zeros(B, 1), torch.zeros(B, 1), torch.zeros(B, dtype=torch.long))

    def step(self, tokens: Tensor, state: DecoderState, memory: Memory
             ) -> tuple[Tensor, DecoderState, Tensor]:
        B, n_loc = tokens.size(0), memory.values.size(1)
        return self.table[tokens].clone(), state, torch.full((B, n_loc), 1.0 / n_loc)


def markov_table() -> Tensor:
    #            pad  start  end    unk    w4     w5
    rows = {
        START: [0.0, 0.0, 0.50, 0.02, 0.45, 0.03],  # "<end>" alone: log 0.5 = -0.69
        4: [0.0, 0.0, 0.80, 0.2 / 3, 0.2 / 3, 0.2 / 3],  # "w4 <end>": log 0.45 + log 0.8 = -1.02
        5: [0.0, 0.0, 0.80, 0.2 / 3, 0.2 / 3, 0.2 / 3],
        UNK: [0.0, 0.0, 0.80, 0.2 / 3, 0.2 / 3, 0.2 / 3],
    }
    table = torch.full((6, 6), 1 / 6)  # rows after <pad>/<end>/<start>: never used
    for r, p in rows.items():
        table[r] = torch.tensor(p)
    return table


def test_length_penalty_flips_short_and_long() -> None:
    dec = MarkovDecoder(markov_table())
    feats = torch.zeros(1, L, D)
    short, long = (END,), (4, END)
    s_short, s_long = math.log(0.5), math.log(0.45) + math.log(0.8)
    assert s_short > s_long  # raw log-probability prefers the short caption
    # length_normalised flips the order once 2^α > s_long / s_short, i.e. α > 0.56
    flip = math.log(s_long / s_short) / math.log(2)
    assert 0.55 < flip < 0.57
    finished, _ = enumerate_sequences(dec, feats, max_len=5, words=[UNK, 4, 5])
    for lp, expected in ((0.0, short), (0.3, short), (0.5, short), (0.6, long), (1.0, long),
                         (2.0, long)):
        scores = torch.tensor([s_short, s_long])
        norm = length_normalised(scores, torch.tensor([1, 2]), lp)
        assert (norm[0] > norm[1]) == (expected == short)
        assert best_by_normalised(finished, lp)[0] == expected  # also the global optimum
        for k in (2, 4):
            gen = beam_search(dec, feats, beam_size=k, max_len=5, length_penalty=lp)
            assert tuple(hypothesis(gen, 0)) == expected, (lp, k)
            assert gen.scores[0].item() == pytest.approx(s_short if expected == short else s_long,
                                                         abs=1e-5)


# -- banned tokens ------------------------------------------------------------------------------
def test_forbid_unk_and_never_pad_or_start() -> None:
    dec = make_decoder(30)
    with torch.no_grad():
        dec.out.bias[UNK] = 30.0  # <unk> is by far the most likely word everywhere ...
        dec.out.bias[PAD] = 40.0  # ... after <pad> and <start>, which are never emitted anyway
        dec.out.bias[START] = 40.0
    feats = torch.randn(3, L, D)
    plain = greedy_search(dec, feats, max_len=5)
    assert torch.all(plain.tokens == UNK)  # sanity: without the flag <unk> wins
    for gen in (greedy_search(dec, feats, max_len=5, forbid_unk=True),
                beam_search(dec, feats, beam_size=3, max_len=5, forbid_unk=True),
                beam_search(dec, feats, beam_size=3, max_len=5)):
        assert not torch.any((gen.tokens == PAD) & (torch.arange(gen.tokens.size(1)) <
                                                    gen.lengths.unsqueeze(1)))
        assert not torch.any(gen.tokens == START)
    for gen in (greedy_search(dec, feats, max_len=5, forbid_unk=True),
                beam_search(dec, feats, beam_size=3, max_len=5, forbid_unk=True)):
        assert not torch.any(gen.tokens == UNK)
        assert_well_formed(gen, 3, 5)


def test_captioner_generate_plumbing() -> None:
    torch.manual_seed(40)
    model = Captioner(CaptionerConfig(vocab_size=10, backbone="resnet18", grid_size=None,
                                      image_size=64, embed_dim=16, hidden_dim=16, attn_dim=16,
                                      dropout=0.0)).eval()
    with torch.no_grad():
        model.decoder.out.bias[UNK] = 30.0
    feats = torch.randn(2, 4, 512)
    gen = model.generate(feats, DecodeConfig(beam_size=2, max_len=4, forbid_unk=True))
    assert not torch.any(gen.tokens == UNK) and gen.alphas.shape[-1] == 4
    gen = model.generate(torch.randn(2, 3, 64, 64), DecodeConfig(strategy="greedy", max_len=4))
    assert torch.all(gen.tokens == UNK)
    with pytest.raises(ValueError, match="length_penalty"):
        DecodeConfig(length_penalty=-1.0)
    with pytest.raises(ValueError, match="strategy"):
        DecodeConfig(strategy="topk")  # type: ignore[arg-type]
    for name in ("beam_size", "max_len"):
        with pytest.raises(ValueError, match=name):
            DecodeConfig(**{name: 0})
    assert DecodeConfig.from_dict(DecodeConfig(beam_size=5).to_dict()) == DecodeConfig(beam_size=5)
    with pytest.raises(ValueError, match="unknown fields"):
        DecodeConfig.from_dict({"eval_strategy": "beam"})
