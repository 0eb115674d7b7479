"""The teacher-forced pass's packed word positions (`captioning.models.packing`)."""

from __future__ import annotations

import pytest
import torch

from captioning.models import native, packing
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.packing import PackedSteps, dropout_mask


def test_positions_are_time_major_rows_of_the_batch_as_given() -> None:
    # Sorted steps 3, 2, 2, 0 are the given batch's rows 2, 0, 3 and 1.
    pk = PackedSteps.of([3, 2, 2, 0], rows=[2, 0, 3, 1], device=torch.device("cpu"))
    assert (pk.batch, pk.steps, pk.running) == (4, 3, (3, 3, 1))
    # t = 0: rows 2, 0, 3; t = 1: rows 2, 0, 3; t = 2: row 2 (flat position r * T + t)
    assert pk.index.tolist() == [6, 0, 9, 7, 1, 10, 8]


def test_scatter_undoes_gather_and_zeroes_the_padding() -> None:
    steps_given = [2, 0, 3, 2]  # rows of the batch as given
    order = sorted(range(4), key=lambda i: -steps_given[i])
    pk = PackedSteps.of([steps_given[i] for i in order], rows=order, device=torch.device("cpu"))
    x = torch.randn(4, 3, 5)
    packed = pk.gather(x)
    assert packed.shape == (7, 5)
    real = torch.arange(3) < torch.tensor(steps_given).unsqueeze(1)  # (B, T)
    torch.testing.assert_close(pk.scatter(packed), torch.where(real.unsqueeze(-1), x, 0.0),
                               rtol=0, atol=0)
    rows = list(pk.gather(x).split(pk.running))  # one (b_t, 5) tensor a step
    torch.testing.assert_close(pk.padded(rows), pk.scatter(packed), rtol=0, atol=0)


def test_steps_must_come_sorted_longest_first_and_tensors_batch_first() -> None:
    with pytest.raises(ValueError, match="sorted longest first"):
        PackedSteps.of([2, 3], device=torch.device("cpu"))
    pk = PackedSteps.of([3, 2], device=torch.device("cpu"))
    with pytest.raises(ValueError, match=r"expected \(2, 3, ...\)"):
        pk.gather(torch.zeros(3, 2, 4))  # time-major: refused, not gathered wrongly


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_dropout_drops_what_nn_dropout_drops_on_the_padded_batch(
        dtype: torch.dtype) -> None:
    steps_given = [2, 4, 1, 4, 3]
    order = sorted(range(5), key=lambda i: -steps_given[i])
    pk = PackedSteps.of([steps_given[i] for i in order], rows=order, device=torch.device("cpu"))
    x = torch.randn(5, 4, 16).to(dtype)
    torch.manual_seed(7)
    want = pk.gather(torch.nn.Dropout(0.3)(x))  # dropout of the padded batch, then packed
    torch.manual_seed(7)
    got = pk.dropout(0.3, training=True)(pk.gather(x))
    assert got.dtype == dtype
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert bool(got.eq(0).any()) and bool(got.ne(0).any())
    packed = pk.gather(x)
    assert pk.dropout(0.3, training=False)(packed) is packed
    assert pk.dropout(0.0, training=True)(packed) is packed


@pytest.mark.parametrize("kernel", [True, False], ids=["native-kernel", "no-kernel"])
@pytest.mark.parametrize("serial", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("p", [0.5, 0.3, 0.9, 0.0, 1.0])
def test_dropout_mask_is_f_dropouts_mask_bit_for_bit_from_the_same_stream(
        monkeypatch: pytest.MonkeyPatch, serial: bool, dtype: torch.dtype, p: float,
        kernel: bool) -> None:
    """Every way of drawing it (the native kernel's float32 masks, torch.rand's doubles where
    ATen's Bernoulli draws them one at a time, else F.dropout itself) gives F.dropout's mask
    and leaves the generator where it does."""
    if serial and not packing.serial_cpu_bernoulli():
        pytest.skip("this CPU's bernoulli_ is not the serial one (MKL's, on Intel)")
    if kernel and not native.available():
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setattr(packing, "serial_cpu_bernoulli", lambda: serial)
    monkeypatch.setattr(native, "loaded", lambda: kernel)
    drawn: list[tuple[int, ...]] = []
    real = native.dropout_mask
    monkeypatch.setattr(native, "dropout_mask", lambda shape, keep, gen=None: (
        drawn.append(shape), real(shape, keep, gen))[1])
    shape = (5, 7, 33)  # odd sizes: no vector-width luck
    torch.manual_seed(11)
    want = torch.nn.functional.dropout(torch.ones(shape, dtype=dtype), p, training=True)
    want_next = torch.rand(4)
    torch.manual_seed(11)
    got = dropout_mask(shape, p, dtype=dtype, device=torch.device("cpu"))
    assert got.dtype == dtype and got.shape == shape
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(torch.rand(4), want_next, rtol=0, atol=0)
    if 0 < p < 1:
        assert set(got.unique().tolist()) == {0.0,
                                               float(torch.tensor(1 / (1 - p), dtype=dtype))}
    assert (shape in drawn) == (kernel and serial and dtype == torch.float32 and 0 < p < 1)


@pytest.mark.parametrize("keep", [0.5, 0.7, 0.1, 0.999, 2.0**-60])
@pytest.mark.parametrize("shape", [(3,), (2049,), (3, 701, 2)], ids=["few", "a-block-and-one",
                                                                     "several-blocks"])
def test_the_native_mask_is_torch_rands_draws_below_keep(shape: tuple[int, ...],
                                                        keep: float) -> None:
    """`native.dropout_mask` on a generator mid-state (an odd number of draws taken, so that
    the twister is part-way through its 624 words): the mask (torch.rand(float64) < keep) /
    keep in float32, and the stream where those draws leave it; the default generator too."""
    if not native.available():
        pytest.skip("the native kernels cannot be built here")
    gens = [torch.Generator().manual_seed(5) for _ in range(2)]
    for g in gens:
        torch.rand(623, generator=g)
    want = (torch.rand(shape, dtype=torch.float64, generator=gens[0]) < keep).float().div_(keep)
    got = native.dropout_mask(shape, keep, gens[1])
    assert got is not None and got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert torch.equal(torch.rand(700, generator=gens[0]), torch.rand(700, generator=gens[1]))
    torch.manual_seed(3)
    want = (torch.rand(shape, dtype=torch.float64) < keep).float().div_(keep)
    after = torch.rand(5)
    torch.manual_seed(3)
    assert torch.equal(native.dropout_mask(shape, keep), want) and torch.equal(torch.rand(5),
                                                                               after)


def test_serial_cpu_bernoulli_matches_what_this_build_draws() -> None:
    """The probe answers by what bernoulli_ does here: True exactly when the default generator's
    bernoulli_ on a large tensor equals torch.rand's doubles kept below p."""
    torch.manual_seed(5)
    bern = torch.empty(20_000).bernoulli_(0.4).bool()
    torch.manual_seed(5)
    rand = torch.rand(20_000, dtype=torch.float64) < 0.4
    assert packing.serial_cpu_bernoulli() == torch.equal(bern, rand)


@pytest.mark.parametrize("training", [False, True])
def test_decoder_outputs_are_zero_past_each_end_and_follow_the_batch_order(
        training: bool) -> None:
    """Logits and α past each caption's end are exactly zero, and an unsorted batch gives
    each caption the outputs it gets in the sorted batch (dropout off, so they are equal)."""
    torch.manual_seed(0)
    dec = AttentionLSTMDecoder(vocab_size=30, feature_dim=8, embed_dim=6, hidden_dim=7,
                               attn_dim=5, dropout=0.0).train(training)
    feats, caps = torch.randn(5, 4, 8), torch.randint(4, 30, (5, 7))
    lengths = torch.tensor([3, 7, 1, 5, 7])  # unsorted, with ties and a caption of no word
    out = dec(feats, caps, lengths)
    real = torch.arange(6) < (lengths - 1).unsqueeze(1)
    assert out.logits.shape == (5, 6, 30) and bool(out.logits[~real].eq(0).all())
    assert bool(out.alphas[~real].eq(0).all()) and bool(out.logits[real].ne(0).any())
    order = torch.argsort(-lengths, stable=True)
    ref = dec(feats[order], caps[order], lengths[order])
    torch.testing.assert_close(out.logits[order], ref.logits, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.alphas[order], ref.alphas, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rule", [None, "expected"])
def test_a_batch_without_words_gives_empty_outputs(rule: str | None) -> None:
    """Every caption is <start> alone: no word to predict, T = 0. Hard attention in training
    samples, so it gives empty log p(s) and H, and which captions semi-sampled; a forced rule
    does not."""
    dec = AttentionLSTMDecoder(vocab_size=30, feature_dim=8, embed_dim=6, hidden_dim=7,
                               attn_dim=5, attention="hard").train()
    out = dec(torch.randn(3, 4, 8), torch.ones(3, 1, dtype=torch.long), torch.ones(3).long(),
              rule=rule)
    assert out.logits.shape == (3, 0, 30) and out.alphas.shape == (3, 0, 4)
    if rule is None:
        assert out.attn_log_probs is not None and out.attn_log_probs.shape == (3, 0)
        assert out.attn_entropy is not None and out.attn_entropy.shape == (3, 0)
        assert out.sampled is not None and out.sampled.shape == (3,)
    else:
        assert out.attn_log_probs is None and out.sampled is None
