"""The image transform shared by training, evaluation, the feature cache and the caption CLI;
`model_input(s)`, an image file or PIL image as a model reads it; and `boxes_to_crop_coords`,
which maps boxes through the eval transform's geometry.

Kept free of Lightning so that `captioning caption` starts fast.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

if TYPE_CHECKING:
    from PIL.Image import Image

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


def model_input(image: str | os.PathLike[str] | Image, image_size: int, *,
                transform: Callable[[Any], Tensor] | None = None) -> Tensor:
    """One image as a model of input size `image_size` reads it, (3, S, S): a file loaded with
    `load_image` (any mode to RGB, EXIF orientation applied; a JPEG decoded no smaller than
    needed), or a PIL image so converted and oriented (a JPEG opened and not yet decoded is
    decoded as its file would be, by `images.draft` on that object, which then holds the reduced
    image: `load()` it first to keep it whole), then the evaluation
    transform (`transform`: built once by a caller with many images). Raises `ImageLoadError`
    for a bad file."""
    from PIL import Image as PILImage
    from PIL import ImageOps

    from captioning.data.images import draft, load_image, to_rgb

    transform = transform or build_image_transform(image_size)
    if isinstance(image, PILImage.Image):  # its EXIF orientation applied, as load_image does
        draft(image, image_size)  # a no-op once its pixels are decoded
        with contextlib.suppress(Exception):  # a broken EXIF block must not lose the image
            image = ImageOps.exif_transpose(image)
        return transform(to_rgb(image))
    return transform(load_image(image, min_side=image_size))


def model_inputs(images: Iterable[str | os.PathLike[str] | Image], image_size: int) -> Tensor:
    """Image files or PIL images as a batch a model of input size `image_size` reads,
    (B, 3, S, S): `model_input` of each; e.g. `model.captions(model_inputs(["a.jpg"],
    model.config.image_size))`."""
    transform = build_image_transform(image_size)
    return torch.stack([model_input(im, image_size, transform=transform) for im in images])


def boxes_to_crop_coords(
    bbox: Sequence[float], width: int, height: int, *, size: int | None = None
) -> tuple[float, float, float, float]:
    """A pixel box [x, y, w, h] of a `width` x `height` image, in normalised [0, 1] xywh of the
    model input made by the eval transform: resize the shorter side, then centre-crop a square.

    The visible square is the centred min(width, height) square of the original image; boxes
    are clipped to it (a box entirely outside gets zero width/height). With `size` (the crop
    side in pixels) torchvision's rounding of Resize(size) + CenterCrop(size) is reproduced
    exactly; without it the continuous geometry is used (they differ by under a pixel).
    """
    x, y, w, h = (float(v) for v in bbox)
    if size is None:
        side = float(min(width, height))
        sx = sy = 1.0 / side
        left, top = (width - side) / 2.0 * sx, (height - side) / 2.0 * sy
    else:
        # torchvision Resize(int): shorter side -> size, longer side truncated to int
        if width <= height:
            new_w, new_h = size, int(size * height / width)
        else:
            new_w, new_h = int(size * width / height), size
        sx, sy = new_w / width / size, new_h / height / size
        left = round((new_w - size) / 2.0) / size  # CenterCrop offsets (Python round)
        top = round((new_h - size) / 2.0) / size
    x0, y0 = min(max(x * sx - left, 0.0), 1.0), min(max(y * sy - top, 0.0), 1.0)
    x1, y1 = min(max((x + w) * sx - left, 0.0), 1.0), min(max((y + h) * sy - top, 0.0), 1.0)
    return x0, y0, x1 - x0, y1 - y0
