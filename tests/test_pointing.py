"""Pointing accuracy: the attention peak against the boxes of the objects a word names."""

from __future__ import annotations

import math

import pytest
import torch

from captioning.data.shapes import parse_objects, shape_of
from captioning.pointing import pointing_accuracy

SHAPES, COLORS, SIZES = ("circle", "square", "triangle", "cross"), ("red", "green", "blue"), (
    "small", "large")
GRID = (2, 2)  # cells: 0 = top-left, 1 = top-right, 2 = bottom-left, 3 = bottom-right


def alpha_rows(*cells: int) -> torch.Tensor:
    a = torch.full((len(cells), 4), 0.1)
    for t, c in enumerate(cells):
        a[t, c] = 0.7
    return a  # (T, L)


def box(color: str, shape: str, x: float, y: float, w: float, h: float) -> dict:
    return {"color": color, "shape": shape, "size": "small", "bbox": [x, y, w, h]}


def pa(words, alphas, boxes):
    return pointing_accuracy(words, alphas, GRID, boxes, object_words=SHAPES,
                             color_words=COLORS, modifier_words=SIZES)


def test_pointing_hit_miss_and_unscored() -> None:
    boxes = [[box("red", "circle", 0.05, 0.05, 0.3, 0.3)]]  # inside the top-left cell
    words = [["a", "red", "circle"]]
    assert pa(words, [alpha_rows(3, 3, 0)], boxes) == (1.0, 1, 1)  # peak on the circle
    assert pa(words, [alpha_rows(0, 0, 3)], boxes) == (0.0, 0, 1)  # peak elsewhere
    # "square" is not in the image: not scored; "a"/"red" are never scored
    acc, hits, scored = pa([["a", "red", "square"]], [alpha_rows(0, 0, 0)], boxes)
    assert (hits, scored) == (0, 0) and math.isnan(acc)


def test_pointing_overlap_not_containment() -> None:
    boxes = [[box("red", "square", 0.4, 0.4, 0.2, 0.2)]]  # straddles all four cells
    words = [["square"]]
    assert all(pa(words, [alpha_rows(c)], boxes)[1] == 1 for c in range(4))
    edge = [[box("red", "square", 0.5, 0.0, 0.5, 0.5)]]  # exactly the top-right cell
    assert pa(words, [alpha_rows(0)], edge)[1] == 0  # touching edges is no overlap
    assert pa(words, [alpha_rows(1)], edge)[1] == 1


def test_tied_peaks_count_the_share_of_them_that_hit() -> None:
    """A uniform α (every cell tied) scores the share of cells on the object, the chance
    level, wherever the object lies; a two-way tie with one cell on it scores a half."""
    words = [["a", "circle"]]
    uniform = torch.full((2, 4), 0.25)
    for corner in ((0.05, 0.05), (0.6, 0.6)):  # top-left, then bottom-right: the same score
        boxes = [[box("red", "circle", *corner, 0.3, 0.3)]]
        assert pa(words, [uniform], boxes) == (0.25, 0.25, 1)
    two = torch.tensor([[0.25] * 4, [0.4, 0.1, 0.1, 0.4]])  # cells 0 and 3 tie at step 1
    assert pa(words, [two], [[box("red", "circle", 0.05, 0.05, 0.3, 0.3)]]) == (0.5, 0.5, 1)
    nan = torch.tensor([[0.25] * 4, [math.nan, 0.7, 0.2, 0.1]])  # a NaN weight is no peak
    assert pa(words, [nan], [[box("red", "circle", 0.6, 0.05, 0.3, 0.3)]]) == (1.0, 1.0, 1)
    all_nan = torch.full((2, 4), math.nan)  # every cell ties: the chance level, no crash
    assert pa(words, [all_nan], [[box("red", "circle", 0.6, 0.05, 0.3, 0.3)]]) == (0.25, 0.25, 1)


def test_pointing_colour_disambiguation_and_plurals() -> None:
    boxes = [[box("red", "circle", 0.05, 0.05, 0.3, 0.3),   # top-left
              box("blue", "circle", 0.6, 0.6, 0.3, 0.3),    # bottom-right
              box("green", "square", 0.6, 0.05, 0.3, 0.3)]]  # top-right
    blue = [["a", "blue", "circle"]]
    assert pa(blue, [alpha_rows(0, 0, 3)], boxes)[1:] == (1, 1)
    assert pa(blue, [alpha_rows(0, 0, 0)], boxes)[1:] == (0, 1)  # on the red one: a miss
    # one size word between colour and shape is skipped ("blue small circle"), two are not
    assert pa([["a", "blue", "small", "circle"]], [alpha_rows(0, 0, 0, 3)], boxes)[1:] == (1, 1)
    assert pa([["a", "blue", "small", "circle"]], [alpha_rows(0, 0, 0, 0)], boxes)[1:] == (0, 1)
    two_mods = [["blue", "small", "large", "circle"]]
    assert pa(two_mods, [alpha_rows(0, 0, 0, 0)], boxes)[1:] == (1, 1)  # any circle counts
    # no colour: either circle counts; plural form
    assert pa([["two", "circles"]], [alpha_rows(0, 0)], boxes)[1:] == (1, 1)
    assert pa([["two", "circles"]], [alpha_rows(0, 1)], boxes)[1:] == (0, 1)
    # a colour no circle has: falls back to all circles
    assert pa([["green", "circle"]], [alpha_rows(0, 3)], boxes)[1:] == (1, 1)
    # the colour must precede the shape directly (a non-modifier word breaks the link)
    assert pa([["blue", "and", "circle"]], [alpha_rows(0, 0, 0)], boxes)[1:] == (1, 1)


def test_pointing_batched_tensor_and_list_agree() -> None:
    boxes = [[box("red", "circle", 0.05, 0.05, 0.3, 0.3)],
             [box("blue", "square", 0.6, 0.6, 0.3, 0.3), box("red", "cross", 0.1, 0.6, 0.2, 0.2)]]
    words = [["a", "red", "circle", "<end>"], ["a", "blue", "square", "and", "a", "red", "cross"]]
    a = torch.zeros(2, 7, 4)
    a[0, :3] = alpha_rows(1, 1, 0)
    a[1] = alpha_rows(0, 0, 3, 0, 0, 0, 1)  # circle hit, square hit, cross miss
    res_tensor = pa(words, a, boxes)
    res_list = pa(words, [a[0, :4], a[1].numpy()], boxes)
    assert res_tensor == res_list
    assert res_tensor[1:] == (2, 3) and res_tensor[0] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="alphas"):
        pa(words, [a[0, :2], a[1]], boxes)  # fewer steps than words


def test_pointing_default_words_from_shapes_module() -> None:
    from captioning.data import shapes  # the package's own module: never skipped
    colour, shape = shapes.COLORS[0], shapes.SHAPES[0]
    boxes = [[{"color": colour, "shape": shape, "bbox": [0.0, 0.0, 0.4, 0.4]}]]
    assert pointing_accuracy([[colour, shape]], [alpha_rows(1, 0)], GRID, boxes)[1:] == (1, 1)


def test_a_word_names_a_shape_singular_or_plural_by_one_rule() -> None:
    names = {"box", "bus", "circle"}
    assert [shape_of(w, names) for w in ("box", "boxes", "buses", "circles", "circle", "red",
                                         "boxs", "es")] == \
        ["box", "box", "bus", "circle", "circle", None, "box", None]
    # the shapes data's own caption parser follows it
    assert parse_objects("two red circles and a blue square") == {("red", "circle"),
                                                                   ("blue", "square")}
