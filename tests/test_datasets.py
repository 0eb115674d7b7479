"""Datasets and collation."""

from __future__ import annotations

import torch

from captioning.data.datasets import CaptionCollate


def test_collate_handles_feature_tensors() -> None:
    items = [(torch.randn(7, 5), torch.tensor([1, 4, 2]), "a", ["x"]),
             (torch.randn(7, 5), torch.tensor([1, 4, 5, 6, 2]), "b", ["y z"])]
    batch = CaptionCollate(pad_id=0)(items)
    assert batch.images.shape == (2, 7, 5)
    assert batch.image_ids == ["b", "a"] and batch.lengths.tolist() == [5, 3]
    assert batch.captions.tolist() == [[1, 4, 5, 6, 2], [1, 4, 2, 0, 0]]
    assert torch.equal(batch.images[0], items[1][0])
