"""Datasets and collation."""

from __future__ import annotations

import pytest
import torch

from captioning.data.datasets import CaptionBatch, CaptionCollate


def test_collate_handles_feature_tensors() -> None:
    items = [(torch.randn(7, 5), torch.tensor([1, 4, 2]), "a", ["x"]),
             (torch.randn(7, 5), torch.tensor([1, 4, 5, 6, 2]), "b", ["y z"])]
    batch = CaptionCollate(pad_id=0)(items)
    assert batch.images.shape == (2, 7, 5)
    assert batch.image_ids == ["b", "a"] and batch.lengths.tolist() == [5, 3]
    assert batch.captions.tolist() == [[1, 4, 5, 6, 2], [1, 4, 2, 0, 0]]
    assert torch.equal(batch.images[0], items[1][0])


class _Moved:
    """A stand-in tensor that records how it was moved."""

    def __init__(self) -> None:
        self.moves: list[tuple[torch.device, bool]] = []

    def to(self, device: torch.device, *, non_blocking: bool = False) -> _Moved:
        self.moves.append((device, non_blocking))
        return self


def test_lightning_moves_a_batch_by_its_to_without_blocking_on_cuda() -> None:
    """Lightning hands a batch object its device only; the batch copies its tensors without
    blocking to CUDA (as Lightning copies a tensor) and blocking to the CPU."""
    from lightning.fabric.utilities.apply_func import move_data_to_device

    parts = [_Moved(), _Moved(), _Moved()]
    refs = [["a red square"]]
    batch = CaptionBatch(*parts, [7], refs)  # type: ignore[arg-type]
    for device in ("cuda:0", "cpu"):
        moved = move_data_to_device(batch, torch.device(device))
        assert isinstance(moved, CaptionBatch) and moved.references is refs
    for part in parts:
        assert part.moves == [(torch.device("cuda:0"), True), (torch.device("cpu"), False)]
    assert batch.to("cuda:0", non_blocking=False).images is parts[0]
    assert parts[0].moves[-1] == (torch.device("cuda:0"), False)
    with pytest.raises(TypeError):  # a dtype is no device: the captions would be cast
        batch.to(torch.bfloat16)  # type: ignore[arg-type]
