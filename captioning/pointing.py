"""Pointing accuracy: how often the attention peak falls on the object a generated word names.

Grounded in object boxes (the shapes dataset's boxes.json, or any boxes file in that layout).
The module imports neither torch nor the shapes data module at import time.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


def _default_words() -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    from captioning.data import shapes

    return tuple(shapes.SHAPES), tuple(shapes.COLORS), tuple(shapes.SIZES)


def _word_sets(
    object_words: Iterable[str] | None,
    color_words: Iterable[str] | None,
    modifier_words: Iterable[str] | None,
) -> tuple[set[str], set[str], set[str]]:
    """(object names, colours, modifiers); each one not given comes from the shapes module."""
    if object_words is None or color_words is None or modifier_words is None:
        d_shapes, d_colors, d_sizes = _default_words()
        object_words = d_shapes if object_words is None else object_words
        color_words = d_colors if color_words is None else color_words
        modifier_words = d_sizes if modifier_words is None else modifier_words
    return set(object_words), set(color_words), set(modifier_words)


def _attention_peaks(alpha: Any, i: int, n_words: int, n_cells: int) -> list[list[int]]:
    """Flat indices of the argmax cells of each of the first `n_words` rows of the (T, L)
    attention `alpha` of caption `i`: one, or every cell of a tie (a uniform α: all)."""
    import torch

    a = torch.as_tensor(alpha)  # (T, L)
    if a.dim() != 2 or a.shape[1] != n_cells or a.shape[0] < n_words:
        raise ValueError(
            f"alphas[{i}] must be (T >= {n_words}, L = {n_cells}), got {tuple(a.shape)}"
        )
    a = a[:n_words].float().nan_to_num(nan=-math.inf)  # a NaN weight is no peak
    top = a == a.max(dim=1, keepdim=True).values  # (T, L); an all-NaN row: every cell ties
    return [row.nonzero().flatten().tolist() for row in top]


def _referred_objects(
    caption: Sequence[str],
    t: int,
    objects: Sequence[Mapping[str, Any]],
    names: Collection[str],
    colors: Collection[str],
    modifiers: Collection[str],
) -> list[Mapping[str, Any]]:
    """The objects of the image that caption[t] refers to; empty when the word names no object
    class, or one absent from the image (then it is not scored).

    They are the objects of the named shape, narrowed to one colour when the word right before
    it, or the one before a single modifier ("red large circle"), is a colour word that one of
    them has (`shapes.bound_colour`, the rule of `shapes.parse_objects` too).
    """
    from captioning.data.shapes import (  # not at import time (module docstring)
        bound_colour,
        shape_of,
    )

    shape = shape_of(caption[t], names)
    if shape is None:
        return []
    referred = [o for o in objects if o["shape"] == shape]
    if not referred:
        return []

    colour = bound_colour(caption, t, colours=colors, sizes=modifiers)
    if colour is not None and any(o["color"] == colour for o in referred):
        referred = [o for o in referred if o["color"] == colour]
    return referred


def _cell_overlaps_any(
    cell: tuple[int, int], grid: tuple[int, int], objects: Iterable[Mapping[str, Any]]
) -> bool:
    """Whether grid cell (r, c), the rectangle [c/gw, (c+1)/gw) x [r/gh, (r+1)/gh) of the input,
    and the [x, y, w, h] "bbox" of one of `objects` overlap with positive area."""
    (r, c), (gh, gw) = cell, grid
    cx0, cx1, cy0, cy1 = c / gw, (c + 1) / gw, r / gh, (r + 1) / gh
    for o in objects:
        x, y, w, h = (float(v) for v in o["bbox"])
        if min(cx1, x + w) - max(cx0, x) > 0 and min(cy1, y + h) - max(cy0, y) > 0:
            return True
    return False


def pointing_accuracy(
    words: Sequence[Sequence[str]],
    alphas: Tensor | Sequence[Any],
    grid: tuple[int, int],
    boxes: Sequence[Sequence[Mapping[str, Any]]],
    *,
    object_words: Iterable[str] | None = None,
    color_words: Iterable[str] | None = None,
    modifier_words: Iterable[str] | None = None,
) -> tuple[float, float, int]:
    """How often the attention peak falls on the object a generated word names.

    words[i][t] is the t-th generated word of caption i and alphas[i][t] (L = gh*gw weights,
    row-major over the (gh, gw) grid) the attention used to emit it; `alphas` is a (N, T, L)
    tensor or a list of (T_i, L) tensors/arrays with T_i >= len(words[i]). boxes[i] lists the
    objects of image i as dicts with "color", "shape" and "bbox" = [x, y, w, h] normalised to
    [0, 1] in the model input (see `captioning.data.transforms.boxes_to_crop_coords`).

    Scored words: a word naming an object class (in `object_words`, default shapes.SHAPES;
    plural "-s"/"-es" forms count) whose class occurs in the image. The referred objects are
    the image's objects of that shape; when the word right before it, or the one before a
    single modifier (`modifier_words`, default shapes.SIZES: "red large circle"), is a colour
    word (default shapes.COLORS) that one of them has, only those of that colour: the rule
    of `shapes.bound_colour`, which `shapes.parse_objects` follows too. Words whose shape is
    absent from the image are not scored.

    Hit criterion: the argmax cell (r, c) of alphas[i][t] covers the rectangle
    [c/gw, (c+1)/gw) x [r/gh, (r+1)/gh) of the input; the word is a hit when this rectangle
    and the box of a referred object overlap with positive area (intersection, not
    containment: with coarse grids such as 7x7 one cell is a large region, and a small object
    may lie wholly inside it or straddle several cells). Where several cells tie for the
    peak, the word counts the share of them that hit: a uniform α scores the chance level,
    not whether the first cell happens to hit.

    Returns (hits / scored, hits, scored); accuracy is NaN when nothing was scored.
    """
    gh, gw = grid
    names, colors, modifiers = _word_sets(object_words, color_words, modifier_words)
    if not (len(words) == len(alphas) == len(boxes)):
        raise ValueError(
            f"words, alphas and boxes must have one entry per caption, got "
            f"{len(words)}, {len(alphas)}, {len(boxes)}"
        )

    hits, scored = 0.0, 0
    for i, caption in enumerate(words):
        if not caption:
            continue
        peaks = _attention_peaks(alphas[i], i, len(caption), gh * gw)  # (T,) flat cell index
        for t in range(len(caption)):
            referred = _referred_objects(caption, t, boxes[i], names, colors, modifiers)
            if not referred:
                continue
            scored += 1
            on = [_cell_overlaps_any(divmod(c, gw), grid, referred) for c in peaks[t]]
            hits += sum(on) / len(on)
    return (hits / scored if scored else math.nan), hits, scored
