"""Work run once per distinct row (`captioning.models.repeats`): repeats are found exactly,
the frozen encoder and the key projection then see each image once, and nothing changes in
what they return."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn

from captioning.models.captioner import Captioner, CaptionerConfig
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.repeats import (
    FINGERPRINT_ENTRIES,
    MIN_REPEATS,
    per_distinct_row,
    repeated_rows,
)


def _grouped(n_images: int, per_image: int, shape: tuple[int, ...], *, seed: int = 0,
             dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """Rows showing `n_images` images `per_image` times each, shuffled; and each row's image."""
    g = torch.Generator().manual_seed(seed)
    distinct = torch.randn(n_images, *shape, generator=g).to(dtype)
    image = torch.randperm(n_images * per_image, generator=g) % n_images
    return distinct[image].contiguous(), image


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_repeated_rows_are_found_exactly(dtype: torch.dtype) -> None:
    x, image = _grouped(7, 5, (49, 24), dtype=dtype)
    found = repeated_rows(x)
    assert found is not None
    first, inverse = found
    assert len(first) == 7 and torch.equal(x[first][inverse], x)
    assert len(set(image[first].tolist())) == 7  # one row of each image
    assert torch.equal(inverse.unsqueeze(1) == inverse.unsqueeze(0),
                       image.unsqueeze(1) == image.unsqueeze(0))


def test_distinct_rows_and_a_fingerprint_collision_run_every_row() -> None:
    x = torch.randn(6, 3, FINGERPRINT_ENTRIES)  # rows longer than the fingerprint reads
    assert repeated_rows(x) is None
    assert repeated_rows(x[:1]) is None
    y = x[torch.tensor([0, 0, 0, 0, 0, 1, 2, 3])].clone()
    assert repeated_rows(y) is not None  # four repeats of row 0
    y[1, 0, 1] += 1.0  # row 1 differs from row 0 at an entry the fingerprint skips
    stride = y[0].numel() // FINGERPRINT_ENTRIES
    assert stride > 1 and 1 % stride != 0
    assert repeated_rows(y) is None  # proposed by the fingerprint, refused by the full check


def test_too_few_repeats_to_pay_are_left_alone() -> None:
    x = torch.randn(32, 8)
    three = x.clone()
    three[29:] = x[0]  # 3 repeats in 32 rows: fewer than MIN_REPEATS
    assert repeated_rows(three) is None
    four = x.clone()
    four[28:] = x[0]
    found = repeated_rows(four)
    assert found is not None and len(found[0]) == 32 - MIN_REPEATS


class Counting(nn.Module):
    """A row-wise function that records the batch sizes it was called with."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(24, 8)
        self.calls: list[int] = []

    def forward(self, x: Tensor) -> Tensor:
        self.calls.append(x.size(0))
        return self.linear(x)


def test_per_distinct_row_gives_every_row_its_own_result_and_gradient() -> None:
    x, _ = _grouped(4, 5, (49, 24), seed=1, dtype=torch.float64)  # sums in another order
    torch.manual_seed(0)
    fn = Counting().double()
    shared = per_distinct_row(x, fn)
    fn.linear.zero_grad()
    shared.square().sum().backward()
    grads = [p.grad.clone() for p in fn.linear.parameters()]
    fn.linear.zero_grad()
    full = fn(x)
    full.square().sum().backward()
    assert fn.calls == [4, 20]  # once per image, then every row
    torch.testing.assert_close(shared, full, rtol=0, atol=1e-6)
    for a, p in zip(grads, fn.linear.parameters()):
        torch.testing.assert_close(a, p.grad, rtol=1e-5, atol=1e-5)
    # Rows that need a gradient (a trained encoder's grid) are never merged.
    fn.calls.clear()
    per_distinct_row(x.clone().requires_grad_(), fn)
    assert fn.calls == [20]


def test_the_key_projection_runs_once_per_image_in_training() -> None:
    torch.manual_seed(0)
    dec = AttentionLSTMDecoder(vocab_size=30, feature_dim=24, embed_dim=16, hidden_dim=16,
                               attn_dim=16)
    rows: list[int] = []
    dec.attention.key.register_forward_hook(lambda m, i, o: rows.append(i[0].size(0)))
    feats, _ = _grouped(3, 5, (49, 24), seed=2)
    lengths = torch.randint(3, 9, (15,))
    dec(feats, torch.randint(4, 30, (15, 9)), lengths)
    dec(feats[torch.randperm(15)[:3]] + torch.arange(3.0).view(3, 1, 1),
        torch.randint(4, 30, (3, 9)), lengths[:3])
    assert rows == [3, 3]  # 15 captions of 3 images; then 3 captions of 3 different images


def test_the_frozen_encoder_sees_each_image_once() -> None:
    torch.manual_seed(0)
    model = Captioner(CaptionerConfig(vocab_size=20, backbone="mobilenet_v2", weights=None,
                                      image_size=64, embed_dim=16, hidden_dim=16, attn_dim=16))
    model.eval()
    seen: list[int] = []
    model.encoder.register_forward_pre_hook(lambda m, i: seen.append(i[0].size(0)))
    images, image = _grouped(2, 3, (3, 64, 64), seed=3)
    grid = model.encode(images)
    alone = torch.cat([model.encode(images[i: i + 1]) for i in range(6)])
    assert seen[0] == 2
    torch.testing.assert_close(grid, alone, rtol=1e-5, atol=1e-5)
    assert torch.equal(grid[0], grid[(image == image[0]).nonzero()[-1, 0]])
