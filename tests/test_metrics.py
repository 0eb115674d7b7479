"""Metrics: coco-caption scores (Java), SPICE availability, object accuracy."""

from __future__ import annotations

import itertools
import logging
import os
from pathlib import Path

import pytest
from conftest import needs_java

from captioning import metrics
from captioning.metrics import (
    coco_scores,
    objects_correct,
    spice_available,
    strip_special_tokens,
)

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
    metrics.close_meteor(meteor_scorer)
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
    spice_dir = metrics.spice_dir_path()
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
    from captioning.data import shapes  # the package's own module: never skipped
    colour, shape = shapes.COLORS[0], shapes.SHAPES[0]
    caption = f"a {colour} {shape}"
    assert shapes.parse_objects(caption) == {(colour, shape)}  # the data module's contract
    assert objects_correct({0: caption}, {0: {(colour, shape)}}) == 1.0


@needs_java
def test_chinese_captions_are_scored_a_character_a_token() -> None:
    """References written without spaces and the model's hypothesis (its tokens joined by
    spaces) are read alike: a character a token, as `tokenize` trains the model."""
    from captioning.metrics import coco_scores
    from captioning.vocab import tokenize

    refs = {1: ["一只猫在桌子上", "桌子上有一只猫"], 2: ["两只狗在草地上跑", "草地上的两只狗"]}
    hyps = {1: " ".join(tokenize("一只猫在桌子上")), 2: " ".join(tokenize("两只狗在草地上"))}
    scores = coco_scores(refs, hyps)
    assert scores["BLEU-1"] > 0.9 and scores["BLEU-4"] > 0.5  # one token a sentence gave 0
    # punctuation the model never emits (tokenize drops it) is not scored in the references
    refs = {1: ["「一只猫」在桌子上。"], 2: ["两只狗、在草地上跑！"]}
    hyps = {k: " ".join(tokenize(r[0])) for k, r in refs.items()}
    assert coco_scores(refs, hyps)["BLEU-4"] == pytest.approx(1.0)
