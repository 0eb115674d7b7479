"""Images to caption with `Trainer.predict` (`captioning predict`): a dataset of image paths
and the collate that drops the images that failed to load.

A failed image does not stop the DataLoader: the dataset returns the loader's message in
place of the tensor, and the collate stacks the good images and keeps the failures (input
index, path, `path: reason`) in the batch, where the prediction writer reports and counts
them. Batches carry the input index of every image, so that the results of several ranks
are merged back into input order, each image once.

Lightning's predict sampler gives every rank its own inputs and needs at least one per rank:
`min_len` pads a short list with repeats (dropped again by the writer's merge; a repeat that
fails to load is not reported twice).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from captioning.data.images import ImageLoadError
from captioning.data.transforms import build_image_transform, model_input


@dataclass
class PredictBatch:
    """Loaded images with their input indices and paths; the inputs that failed to load."""

    indices: list[int]
    paths: list[str]
    images: Tensor  # (B, 3, S, S) normalised; B may be 0 when every image failed
    failures: list[tuple[int, str, str]] = field(default_factory=list)  # (index, path, message)


class PredictImages(Dataset):
    """`paths[i]` loaded with the project's loader and evaluation transform.

    Item i is `(i, path, image tensor)`, or `(i, path, "path: reason")` when the image cannot
    be loaded (missing, not an image, truncated, too large, ...). With `min_len` the dataset
    has at least that many items: item n + k repeats item k (n = len(paths)), with None in
    place of the message when it fails."""

    def __init__(self, paths: Sequence[str | Path], image_size: int, *, min_len: int = 0) -> None:
        self.paths = [str(p) for p in paths]
        self.image_size = image_size
        self.min_len = min_len
        self.transform = build_image_transform(image_size)

    def __len__(self) -> int:
        return max(len(self.paths), self.min_len) if self.paths else 0

    def __getitem__(self, item: int) -> tuple[int, str, Tensor | str | None]:
        index = item % len(self.paths)
        path = self.paths[index]
        try:
            return index, path, model_input(path, self.image_size, transform=self.transform)
        except ImageLoadError as e:
            return index, path, str(e) if item == index else None


class PredictCollate:
    """DataLoader `collate_fn` (picklable): stacks the loaded images and keeps the failed ones
    in `failures` (failed repeats are dropped); a batch where every image failed holds an
    empty (0, 3, S, S) tensor."""

    def __init__(self, image_size: int) -> None:
        self.image_size = image_size

    def __call__(self, items: Sequence[tuple[int, str, Tensor | str | None]]) -> PredictBatch:
        good = [(i, p, x) for i, p, x in items if isinstance(x, Tensor)]
        failures = [(i, p, x) for i, p, x in items if isinstance(x, str)]
        size = self.image_size
        images = torch.stack([x for *_, x in good]) if good else torch.empty(0, 3, size, size)
        return PredictBatch([i for i, *_ in good], [p for _, p, _ in good], images, failures)


def predict_loader(paths: Sequence[str | Path], image_size: int, *, batch_size: int = 32,
                   num_workers: int = 0, pin_memory: bool = False, world_size: int = 1) -> Any:
    """A DataLoader over `PredictImages` in input order (Lightning shards it under DDP), with
    at least one item for each of `world_size` ranks."""
    from torch.utils.data import DataLoader

    dataset = PredictImages(paths, image_size, min_len=world_size)
    return DataLoader(dataset, batch_size=batch_size, shuffle=False,
                      num_workers=num_workers, collate_fn=PredictCollate(image_size),
                      pin_memory=pin_memory, persistent_workers=False)
