"""The image transform shared by training, evaluation, the feature cache and the caption CLI.

Kept free of Lightning so that `captioning caption` starts fast.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

IMAGENET_MEAN: tuple[float, float, float] = (0.485, 0.456, 0.406)
IMAGENET_STD: tuple[float, float, float] = (0.229, 0.224, 0.225)


def build_image_transform(image_size: int, *, train: bool = False,
                          hflip: bool = False) -> Callable[[Any], Tensor]:
    """PIL image -> (3, S, S) float tensor: resize shorter side to S, centre crop, normalise."""
    from torchvision.transforms import v2

    ops: list[Any] = [v2.Resize(image_size, antialias=True), v2.CenterCrop(image_size)]
    if train and hflip:
        ops.append(v2.RandomHorizontalFlip())
    ops += [v2.PILToTensor(), v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    return v2.Compose(ops)
