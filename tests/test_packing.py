"""The teacher-forced pass's packed word positions (`captioning.models.packing`)."""

from __future__ import annotations

import pytest
import torch

from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.packing import PackedSteps


def test_positions_are_time_major_rows_of_the_batch_as_given() -> None:
    # Sorted steps 3, 2, 2, 0 are the given batch's rows 2, 0, 3 and 1.
    pk = PackedSteps.of([3, 2, 2, 0], rows=[2, 0, 3, 1], device=torch.device("cpu"))
    assert (pk.batch, pk.steps, pk.running) == (4, 3, [3, 3, 1])
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


def test_steps_must_come_sorted_longest_first() -> None:
    with pytest.raises(ValueError, match="sorted longest first"):
        PackedSteps.of([2, 3], device=torch.device("cpu"))


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
