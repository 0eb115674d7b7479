"""`captioning score`: a results JSON (by image_id, as `test` writes it, or by file_name, as
`predict` writes it) scored against a Karpathy split file or a raw COCO captions file, with the
same scores as `coco_scores` on the same captions; every bad entry listed at once."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import needs_java

from captioning.cli import main
from captioning.commands.score import match_results
from captioning.data.problems import DataError
from captioning.data.readers import read_references

CAPTIONS = {  # image id -> (file name, folder, split, references)
    1: ("a.jpg", "train2014", "train", ["a red square", "a red box"]),
    2: ("b.jpg", "val2014", "test", ["a blue circle on the left", "a blue round circle"]),
    3: ("c.jpg", "val2014", "test", ["a green square at the top", "green square"]),
    4: ("d.jpg", "val2014", "test", ["a small red circle", "a red circle"]),
    5: ("a.jpg", "val2014", "val", ["a yellow square", "yellow box"]),  # a.jpg again
}
HYPOTHESES = {2: "a blue circle", 3: "a green square", 4: "a red circle on the left"}


@pytest.fixture
def karpathy(tmp_path: Path, write_karpathy: Callable[..., Path]) -> Path:
    return write_karpathy(tmp_path / "dataset_coco.json", [
        {"id": i, "filename": f, "filepath": d, "split": s, "captions": c}
        for i, (f, d, s, c) in CAPTIONS.items()])


def results(tmp_path: Path, entries: list[Any], name: str = "results.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(entries))
    return path


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, str, list[str]]:
    rc = main(["score", *map(str, args)])
    out, err = capsys.readouterr()
    return rc, out, [ln for ln in err.splitlines() if ln.strip()]


@needs_java
def test_scores_equal_coco_scores_by_id_and_by_file_name(
        karpathy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from captioning.metrics import coco_scores

    want = coco_scores({i: CAPTIONS[i][3] for i in HYPOTHESES}, HYPOTHESES)
    by_id = results(tmp_path, [{"image_id": i, "caption": c} for i, c in HYPOTHESES.items()])
    rc, out, _ = run(capsys, by_id, "--references", karpathy, "--split", "test", "--json",
                     "--out", tmp_path / "scores.json")
    assert rc == 0 and json.loads(out) == pytest.approx(want)
    assert json.loads((tmp_path / "scores.json").read_text()) == pytest.approx(want)
    # --eval-references 1: each image's first reference only (data.eval_references)
    rc, out, _ = run(capsys, by_id, "--references", karpathy, "--json", "--eval-references", "1")
    first = coco_scores({i: CAPTIONS[i][3][:1] for i in HYPOTHESES}, HYPOTHESES)
    assert rc == 0 and json.loads(out) == pytest.approx(first) and first != pytest.approx(want)
    rc, _, err = run(capsys, by_id, "--references", karpathy, "--eval-references", "0")
    assert rc == 2 and err == ["error: --eval-references must be >= 1, got 0"]
    by_name = results(tmp_path, [  # predict's records: the path as given, more keys
        {"file_name": f"/elsewhere/{CAPTIONS[i][0]}", "caption": c, "score": -1.0}
        for i, c in HYPOTHESES.items()], "predicted.json")
    rc, out, _ = run(capsys, by_name, "--references", karpathy)
    assert rc == 0
    lines = dict(ln.split() for ln in out.splitlines())
    assert list(lines) == list(want)
    assert {k: float(v) for k, v in lines.items()} == pytest.approx(want, abs=5e-5)


@needs_java
def test_predicts_output_is_scored_against_a_coco_captions_file(
        tmp_path: Path, write_coco: Callable[..., Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    from captioning.metrics import coco_scores

    coco = write_coco(tmp_path / "captions_val2014.json",
                      [(i, CAPTIONS[i][0]) for i in HYPOTHESES],
                      [(i, c) for i in HYPOTHESES for c in CAPTIONS[i][3]])
    assert read_references(coco)[1] == "coco"
    entries = [{"file_name": f"images/{CAPTIONS[i][0]}", "caption": c}  # as predict writes
               for i, c in HYPOTHESES.items()]
    rc, out, _ = run(capsys, results(tmp_path, entries), "--references", coco, "--json")
    assert rc == 0
    assert json.loads(out) == pytest.approx(coco_scores(
        {i: CAPTIONS[i][3] for i in HYPOTHESES}, HYPOTHESES))
    rc, _, err = run(capsys, results(tmp_path, entries), "--references", coco, "--split", "test")
    assert rc == 2 and err == [f"error: --split: {coco} is a COCO captions file, which holds "
                               "one split; drop --split"]


def test_every_bad_entry_is_listed_with_its_field(karpathy: Path, tmp_path: Path) -> None:
    records, kind = read_references(karpathy)
    assert kind == "karpathy" and {r.split for r in records} == {"train", "test", "val"}
    bad = results(tmp_path, [
        {"image_id": 2, "caption": "a circle"},
        {"image_id": 99, "caption": "a square"},          # no such image
        {"image_id": 2, "caption": "again"},              # image 2 twice
        {"file_name": "c.jpg", "caption": 7},             # not text
        {"file_name": "a.jpg", "caption": "a square"},    # two images are called a.jpg
        {"caption": "nameless"},
        {"image_id": 4, "file_name": "a.jpg", "caption": "both"},  # image_id wins: fine
        {"image_id": 1, "caption": "a red square"},       # a training image
        "a caption",
        {"image_id": [3], "caption": "a list"},
        {"image_id": True, "caption": "a bool"},
        {"image_id": "3", "caption": "a string id"},
        {"file_name": "", "caption": "no name"},
    ])
    with pytest.raises(DataError) as e:
        match_results(bad, records, split="test")
    assert [(p.entry, p.field, p.message) for p in e.value.problems] == [
        ("[1] (image_id 99)", "image_id", "no image with this id in the references"),
        ("[2] (image_id 2)", "image_id", "image 2 again (first at [0])"),
        ("[3] (file_name 'c.jpg')", "caption", "expected a string, got int"),
        ("[4] (file_name 'a.jpg')", "file_name",
         "names 2 reference images (ids 1, 5): give image_id, or a path with their folders"),
        ("[5]", "image_id", "missing (or file_name)"),
        ("[7] (image_id 1)", "image_id", "image 1 is in the train split, not test"),
        ("[8]", "(entry)", "expected an object, got str"),
        ("[9] (image_id [3])", "image_id", "expected an int or non-empty string, got list"),
        ("[10] (image_id True)", "image_id", "expected an int or non-empty string, got bool"),
        ("[11] (image_id '3')", "image_id",
         "no image with this id in the references (the references have the int id 3)"),
        ("[12] (file_name '')", "file_name", "expected a non-empty string, got str"),
    ]
    assert {p.file for p in e.value.problems} == {str(bad)}
    with pytest.raises(DataError, match="expected a list of results, got dict"):
        match_results(results(tmp_path, {"image_id": 2}), records)
    with pytest.raises(DataError, match="no results to score"):
        match_results(results(tmp_path, []), records)


def test_a_file_name_shared_by_two_images_is_told_apart_by_its_folders(
        karpathy: Path, tmp_path: Path) -> None:
    """`predict` writes the path as given: where two reference images share a file name
    (train2014/a.jpg and val2014/a.jpg), the one whose path ends with more of its folders."""
    records, _ = read_references(karpathy)
    entries = [{"file_name": "val2014/a.jpg", "caption": "a yellow box"},
               {"file_name": "/mnt/copy/train2014/a.jpg", "caption": "a red box"},
               {"file_name": "./c.jpg", "caption": "green square"}]
    refs, hyps = match_results(results(tmp_path, entries), records)
    assert hyps == {5: "a yellow box", 1: "a red box", 3: "green square"}
    assert refs[5] == CAPTIONS[5][3] and refs[1] == CAPTIONS[1][3]


def test_a_results_file_that_covers_part_of_the_split_is_scored_with_a_warning(
        karpathy: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """Only the images of the results are scored, as coco-caption does; the warning says how
    many images of the split were left out."""
    records, _ = read_references(karpathy)
    part = results(tmp_path, [{"image_id": 3, "caption": "a green square"}])
    refs, hyps = match_results(part, records, split="test")
    assert refs == {3: CAPTIONS[3][3]} and hyps == {3: "a green square"}
    from captioning.commands import score

    def scored(references: dict[Any, list[str]], hypotheses: dict[Any, str], *,
               spice: bool) -> dict[str, float]:
        assert (references, hypotheses, spice) == (refs, hyps, False)
        return {"BLEU-4": 0.5}

    import captioning.metrics
    with caplog.at_level(logging.WARNING), pytest.MonkeyPatch.context() as mp:
        mp.setattr(captioning.metrics, "coco_scores", scored)
        assert score.score(part, karpathy, split="test") == {"BLEU-4": 0.5}
    assert [r.getMessage() for r in caplog.records] == [
        f"2 of the 3 test images of {karpathy} have no caption in {part}: scored the one that "
        "does"]


def test_a_caption_table_and_a_file_with_bad_entries_are_references(tmp_path: Path) -> None:
    """A captions.jsonl (ids: its relative paths, as `test_captions.json` names them); with
    `on_bad_data="skip"` a bad reference entry is left out with a warning, as a run with
    `data.on_bad_data: skip` left it out."""
    from captioning.commands.score import reference_records

    table = tmp_path / "captions.jsonl"
    table.write_text("".join(json.dumps({"image": f"img/{n}", "caption": c}) + "\n"
                             for n, c in [("a.png", "a red dog"), ("b.png", "a cat"),
                                          ("b.png", "a black cat"), ("c.png", "  ")]))
    with pytest.raises(DataError, match="line 4: field 'caption'"):
        reference_records(table)
    records, kind = reference_records(table, "skip")
    assert kind == "table" and {r.image_id: r.captions for r in records} == {
        "img/a.png": ("a red dog",), "img/b.png": ("a cat", "a black cat")}
    refs, hyps = match_results(results(tmp_path, [{"image_id": "img/b.png", "caption": "cat"}]),
                               records)
    assert refs == {"img/b.png": ["a cat", "a black cat"]} and hyps == {"img/b.png": "cat"}
