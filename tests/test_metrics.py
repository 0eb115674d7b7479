"""Metrics: coco-caption scores (Java), SPICE availability, object accuracy, pointing."""

from __future__ import annotations

import itertools
import logging
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from captioning import metrics
from captioning.metrics import (
    coco_scores,
    objects_correct,
    spice_available,
    strip_special_tokens,
)
from captioning.pointing import pointing_accuracy

needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="needs Java")

REFS = {
    1: ["A dog runs on the grass.", "A brown dog is running across a lawn.", "dog running"],
    2: ["Two cats sitting on a couch.", "Cats on a sofa, resting."],
    "img3": ["A red circle above a blue square.", "a red circle and a blue square"],
    4: ["A man riding a horse on a beach.", "a person on a horse by the sea"],
}
CLEAN = {1: "a dog running on the grass", 2: "", "img3": "a red circle and a blue square",
         4: "a man on a horse"}
WITH_SPECIALS = {1: "<start> a dog running on the grass <end>", 2: "<start> <end> <pad>",
                 "img3": "a red circle and a <unk> blue square <end> <pad> <pad>",
                 4: "<start> a man on a horse"}

SHAPES, COLORS, SIZES = ("circle", "square", "triangle", "cross"), ("red", "green", "blue"), (
    "small", "large")


def java_children() -> list[str]:
    """Command lines of this process's live child processes that run java (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        for pid in (task / "children").read_text().split():
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if "java" in cmd:
                found.append(cmd)
    return found


def direct_pycocoevalcap(refs: dict, hyps: dict) -> dict[str, float]:
    """The reference computation: pycocoevalcap exactly as coco-caption's COCOEvalCap runs it."""
    from pycocoevalcap.bleu.bleu import Bleu
    from pycocoevalcap.cider.cider import Cider
    from pycocoevalcap.meteor.meteor import Meteor
    from pycocoevalcap.rouge.rouge import Rouge
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    tok = PTBTokenizer()
    gts = tok.tokenize({k: [{"caption": c} for c in v] for k, v in refs.items()})
    res = tok.tokenize({k: [{"caption": hyps[k]}] for k in refs})
    bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
    meteor_scorer = Meteor()
    meteor, _ = meteor_scorer.compute_score(gts, res)
    metrics._close_meteor(meteor_scorer)
    out = {f"BLEU-{i + 1}": b for i, b in enumerate(bleu)}
    out.update(METEOR=meteor, **{"ROUGE-L": Rouge().compute_score(gts, res)[0]},
               CIDEr=Cider().compute_score(gts, res)[0])
    return {k: float(v) for k, v in out.items()}


@pytest.fixture(scope="module")
def ours() -> dict[str, float]:
    return coco_scores(REFS, WITH_SPECIALS)


@pytest.fixture(scope="module")
def reference() -> dict[str, float]:
    return direct_pycocoevalcap(REFS, CLEAN)


# --------------------------------------------------------------------------- coco (Java)


@needs_java
def test_coco_scores_equal_pycocoevalcap(ours, reference) -> None:
    assert set(ours) == set(metrics.COCO_METRICS)
    for key in metrics.COCO_METRICS:
        assert ours[key] == pytest.approx(reference[key], abs=1e-9), key
    assert 0 < ours["BLEU-4"] < ours["BLEU-1"] <= 1 and 0 < ours["METEOR"] < 1
    assert ours["CIDEr"] > 0


@needs_java
def test_special_tokens_are_stripped(ours, reference) -> None:
    # WITH_SPECIALS differs from CLEAN only by special tokens; the scores are identical
    assert all(strip_special_tokens(WITH_SPECIALS[k]) == CLEAN[k] for k in CLEAN)
    assert ours == pytest.approx(reference, abs=1e-9)


@needs_java
def test_empty_hypotheses_silent_no_spice_no_java_left(capfd, caplog) -> None:
    with caplog.at_level(logging.WARNING, logger="captioning.metrics"):
        scores = coco_scores(REFS, {k: "" for k in REFS}, spice=True)
    assert scores["BLEU-1"] == 0 and scores["METEOR"] == 0 and scores["CIDEr"] == 0
    assert scores["ROUGE-L"] == 0
    available, _ = spice_available()
    if not available:
        assert "SPICE" not in scores
        assert any(r.getMessage().startswith("SPICE unavailable: ") for r in caplog.records)
    out, err = capfd.readouterr()
    assert out == "" and err == ""  # the scorers' and tokenizer's chatter was captured
    assert java_children() == []  # METEOR's JVM was shut down


@pytest.mark.slow
@needs_java
def test_meteor_timeout_kills_the_jvm() -> None:
    with pytest.raises(RuntimeError, match="METEOR"):
        coco_scores(REFS, CLEAN, meteor_timeout=0.01)
    assert java_children() == []


def test_mismatched_ids_and_missing_references() -> None:
    with pytest.raises(ValueError, match="same ids"):
        coco_scores(REFS, {1: "a dog"})
    with pytest.raises(ValueError, match="non-empty"):
        coco_scores({1: []}, {1: "a dog"})
    with pytest.raises(ValueError, match="empty"):
        coco_scores({}, {})


def test_missing_java_is_a_clear_error(monkeypatch) -> None:
    monkeypatch.setattr(metrics.shutil, "which", lambda name: None)
    with pytest.raises(RuntimeError, match="Java"):
        coco_scores(REFS, CLEAN)
    ok, reason = spice_available()
    assert not ok and "java" in reason


def test_spice_unavailable_here_with_a_reason() -> None:
    ok, reason = spice_available()
    spice_dir = metrics._spice_dir()
    if spice_dir is not None and (spice_dir / "lib" / "stanford-corenlp-3.6.0.jar").is_file():
        pytest.skip("the Stanford CoreNLP jars are installed")
    assert ok is False
    assert reason and ("stanford-corenlp-3.6.0" in reason or "java" in reason)


def test_strip_special_tokens() -> None:
    assert strip_special_tokens("<start> a <unk> dog <end> <pad><pad>") == "a dog"
    assert strip_special_tokens("<end>") == ""
    assert strip_special_tokens("a <b> dog") == "a <b> dog"


# --------------------------------------------------------------------------- objects


def toy_parse(caption: str) -> set[tuple[str, str]]:
    toks = caption.split()
    return {(a, b.rstrip("s")) for a, b in itertools.pairwise(toks)
            if a in COLORS and b.rstrip("s") in SHAPES}


def test_objects_correct_hand_made() -> None:
    objects = {
        1: {("red", "circle")},
        2: {("red", "circle"), ("blue", "square")},
        3: {("green", "triangle")},
        4: {("blue", "square")},
    }
    hyps = {
        1: "a red circle <end>",  # right
        2: "a blue square and a red circle",  # right, other order
        3: "a green triangle and a red circle",  # one too many
        4: "a green square",  # wrong colour
    }
    assert objects_correct(hyps, objects, parse=toy_parse) == pytest.approx(0.5)
    assert objects_correct({1: "a red circle"}, {1: [("red", "circle")]}, parse=toy_parse) == 1.0
    with pytest.raises(ValueError, match="same ids"):
        objects_correct({1: "a red circle"}, objects, parse=toy_parse)


def test_objects_correct_default_parser() -> None:
    shapes = pytest.importorskip("captioning.data.shapes")
    colour, shape = shapes.COLORS[0], shapes.SHAPES[0]
    caption = f"a {colour} {shape}"
    assert shapes.parse_objects(caption) == {(colour, shape)}  # the data module's contract
    assert objects_correct({0: caption}, {0: {(colour, shape)}}) == 1.0


# --------------------------------------------------------------------------- pointing

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
    shapes = pytest.importorskip("captioning.data.shapes")
    colour, shape = shapes.COLORS[0], shapes.SHAPES[0]
    boxes = [[{"color": colour, "shape": shape, "bbox": [0.0, 0.0, 0.4, 0.4]}]]
    assert pointing_accuracy([[colour, shape]], [alpha_rows(1, 0)], GRID, boxes)[1:] == (1, 1)
