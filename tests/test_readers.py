"""Annotation readers: Karpathy split files and raw COCO captions, and their error reports."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from captioning.data.problems import DataError, Problem
from captioning.data.readers import has_tokens, read_coco_captions, read_karpathy
from captioning.vocab import tokenize

COCO_SPECS = [
    {"id": 11, "filename": "a.jpg", "split": "train", "captions": ["A dog. ", "a big dog"]},
    {"id": 12, "filename": "b.jpg", "split": "restval", "captions": ["a cat"],
     "filepath": "val2014"},
    {"id": 13, "filename": "c.jpg", "split": "val", "captions": ["a bird", "birds"],
     "filepath": "val2014"},
    {"id": 14, "filename": "d.jpg", "split": "test", "captions": ["a fish"],
     "filepath": "val2014"},
]


def test_read_karpathy_coco_layout(tmp_path: Path, write_karpathy: Callable) -> None:
    f = write_karpathy(tmp_path / "dataset_coco.json", COCO_SPECS)
    recs = read_karpathy(f, tmp_path / "coco")
    assert [r.image_id for r in recs] == [11, 12, 13, 14]
    assert [r.split for r in recs] == ["train", "train", "val", "test"]
    assert recs[0].path == tmp_path / "coco" / "train2014" / "a.jpg"
    assert recs[1].path == tmp_path / "coco" / "val2014" / "b.jpg"
    assert recs[0].captions == ("A dog.", "a big dog")  # stripped raw captions
    assert recs.problems == () and recs.skipped_captions == recs.skipped_images == 0
    kept = read_karpathy(f, tmp_path, merge_restval=False)
    assert [r.split for r in kept] == ["train", "restval", "val", "test"]


def test_read_karpathy_flickr_layout(tmp_path: Path, write_karpathy: Callable) -> None:
    specs = [{"id": i, "filename": f"{i}_x.jpg", "split": s, "captions": ["a dog runs"]}
             for i, s in enumerate(["train", "train", "val", "test"])]
    f = write_karpathy(tmp_path / "dataset_flickr8k.json", specs, layout="flickr")
    assert "filepath" not in json.loads(f.read_text())["images"][0]
    recs = read_karpathy(f, tmp_path / "Flicker8k_Dataset")
    assert [r.image_id for r in recs] == [0, 1, 2, 3]
    assert recs[2].path == tmp_path / "Flicker8k_Dataset" / "2_x.jpg"
    assert recs[2].split == "val"


def test_read_coco_captions(tmp_path: Path, write_coco: Callable) -> None:
    f = write_coco(tmp_path / "captions_train2014.json", [(5, "x.jpg"), (3, "y.jpg")],
                   [(3, "a cat"), (5, "a dog"), (3, " two cats\n"), (5, "the dog")])
    recs = read_coco_captions(f, tmp_path / "train2014", split="train")
    assert [(r.image_id, r.captions) for r in recs] == [(5, ("a dog", "the dog")),
                                                         (3, ("a cat", "two cats"))]
    assert recs[0].path == tmp_path / "train2014" / "x.jpg"
    assert {r.split for r in recs} == {"train"}
    with pytest.raises(ValueError, match="split"):
        read_coco_captions(f, tmp_path, split="dev")


def _karpathy_with(tmp_path: Path, mutate: Callable[[dict], Any]) -> Path:
    entries = []
    for i, spec in enumerate(COCO_SPECS):
        entries.append({"filepath": spec.get("filepath", "train2014"),
                        "filename": spec["filename"], "split": spec["split"], "imgid": i,
                        "cocoid": spec["id"],
                        "sentences": [{"tokens": tokenize(c), "raw": c} for c in
                                      spec["captions"]]})
    mutate(entries[1])
    f = tmp_path / "dataset_coco.json"
    f.write_text(json.dumps({"images": entries}))
    return f


def _set(key: str, value: Any) -> Callable[[dict], None]:
    def mutate(entry: dict) -> None:
        entry[key] = value
    return mutate


def _drop(key: str) -> Callable[[dict], None]:
    return lambda entry: entry.pop(key)


def _caption(value: Any) -> Callable[[dict], None]:
    def mutate(entry: dict) -> None:
        entry["sentences"][0]["raw"] = value
    return mutate


@pytest.mark.parametrize(("mutate", "field", "words"), [
    (_drop("filename"), "filename", "missing"),
    (_set("filename", 7), "filename", "non-empty string"),
    (_set("filepath", ["x"]), "filepath", "string"),
    (_set("split", "dev"), "split", "unknown split 'dev'"),
    (_drop("split"), "split", "missing"),
    (_set("split", ["train"]), "split", "expected a string, got list"),
    (_set("split", {"a": 1}), "split", "expected a string, got dict"),
    (_set("sentences", "a cat"), "sentences", "expected a list"),
    (_set("cocoid", 11), "cocoid", "duplicate image id (first at images[0])"),
    (_set("cocoid", 1.5), "cocoid", "expected an int"),
    (_caption(""), "sentences[0].raw", "empty"),
    (_caption("   \n"), "sentences[0].raw", "empty"),
    (_caption("... !!"), "sentences[0].raw", "no word tokens"),
    (_caption(None), "sentences[0].raw", "expected a string"),
])
def test_karpathy_errors_name_file_entry_and_field(tmp_path: Path, mutate: Callable,
                                                   field: str, words: str) -> None:
    f = _karpathy_with(tmp_path, mutate)
    with pytest.raises(DataError) as info:
        read_karpathy(f, tmp_path)
    msg = str(info.value)
    assert str(f) in msg
    assert "images[1]" in msg
    assert f"field '{field}'" in msg
    assert words in msg
    if "duplicate" not in words:
        assert "(id 12)" in msg or "(id 1.5)" in msg


def test_malformed_json_reports_line_and_column(tmp_path: Path) -> None:
    f = tmp_path / "dataset_coco.json"
    f.write_text('{"images": [\n  {"filename": "a.jpg",,}\n]}')
    with pytest.raises(DataError, match=r"dataset_coco\.json: line 2 column 24.*malformed JSON"):
        read_karpathy(f, tmp_path)
    with pytest.raises(DataError, match="does not exist"):
        read_karpathy(tmp_path / "nope.json", tmp_path)
    f.write_text('{"pictures": []}')
    with pytest.raises(DataError, match="field 'images': missing"):
        read_karpathy(f, tmp_path)


def test_a_byte_order_mark_is_read_as_editors_write_it(tmp_path: Path,
                                                       write_karpathy: Callable,
                                                       write_coco: Callable) -> None:
    """Files saved by Windows editors start with a UTF-8 BOM: read as the same JSON."""
    karpathy = write_karpathy(tmp_path / "dataset_coco.json", [
        {"id": 1, "filename": "a.jpg", "split": "train", "captions": ["a dog runs"]}])
    coco = write_coco(tmp_path / "captions.json", [(1, "a.jpg")], [(1, "a dog runs")])
    want = [read_karpathy(karpathy, tmp_path), read_coco_captions(coco, tmp_path, split="val")]
    for f in (karpathy, coco):
        f.write_bytes(b"\xef\xbb\xbf" + f.read_bytes())
    assert [read_karpathy(karpathy, tmp_path),
            read_coco_captions(coco, tmp_path, split="val")] == want


def test_coco_errors_name_file_entry_and_field(tmp_path: Path, write_coco: Callable) -> None:
    f = write_coco(tmp_path / "captions.json", [(1, "a.jpg"), (2, "b.jpg"), (2, "c.jpg")],
                   [(1, "a dog"), (9, "a cat"), (1, "  "), (2, "a cow")])
    data = json.loads(f.read_text())
    del data["annotations"][3]["caption"]
    data["images"][1]["file_name"] = ""
    f.write_text(json.dumps(data))
    with pytest.raises(DataError) as info:
        read_coco_captions(f, tmp_path, split="val")
    problems = info.value.problems
    got = {(p.entry, p.field) for p in problems}
    assert ("images[1] (id 2)", "file_name") in got
    assert ("images[2] (id 2)", "id") in got  # duplicate
    assert ("annotations[1] (id 1001, image_id 9)", "image_id") in got
    assert ("annotations[2] (id 1002, image_id 1)", "caption") in got
    assert ("annotations[3] (id 1003, image_id 2)", "image_id") in got  # rejected image
    assert all(p.file == str(f) for p in problems)
    assert str(f) in str(info.value)


def test_fail_lists_first_ten_problems(tmp_path: Path, write_coco: Callable) -> None:
    f = write_coco(tmp_path / "c.json", [(1, "a.jpg")],
                   [(1, "a dog")] + [(1, "?")] * 15)
    with pytest.raises(DataError) as info:
        read_coco_captions(f, tmp_path, split="train")
    msg = str(info.value)
    assert msg.startswith("15 problems")
    assert "annotations[10]" in msg and "annotations[11]" not in msg
    assert "... and 5 more" in msg
    assert len(info.value.problems) == 15


def test_skip_policy_drops_and_counts(tmp_path: Path, write_karpathy: Callable) -> None:
    specs = [dict(s) for s in COCO_SPECS]
    specs[0]["captions"] = ["a dog", "", "   ", "a big dog"]  # 2 bad captions
    specs[1]["captions"] = ["!!!"]  # image left without captions
    specs[2]["split"] = "dev"  # bad image entry
    f = write_karpathy(tmp_path / "k.json", specs)
    recs = read_karpathy(f, tmp_path, on_error="skip")
    assert [r.image_id for r in recs] == [11, 14]
    assert recs[0].captions == ("a dog", "a big dog")
    assert recs.skipped_captions == 3
    assert recs.skipped_images == 2
    assert {p.field for p in recs.problems} == {"sentences[1].raw", "sentences[2].raw",
                                                "sentences[0].raw", "sentences", "split"}
    assert all(isinstance(p, Problem) for p in recs.problems)
    with pytest.raises(ValueError, match="on_error"):
        read_karpathy(f, tmp_path, on_error="ignore")  # type: ignore[arg-type]


@pytest.mark.parametrize("text", ["", " ", "...", "a", "Ünïcode ok", "K", "İ", "—", "it's",
                                  "'", "x'y", "123", "\u212a"])
def test_fast_token_check_matches_tokenize(text: str) -> None:
    assert has_tokens(text) == bool(tokenize(text))


def test_deeply_nested_json_is_a_data_error_naming_the_file(tmp_path: Path) -> None:
    from captioning.data.tables import read_captions_table

    f = tmp_path / "dataset_coco.json"
    f.write_text('{"images": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(DataError, match=r"dataset_coco\.json: .*nested too deeply"):
        read_karpathy(f, tmp_path)
    table = tmp_path / "captions.jsonl"
    table.write_text('{"image": "a.png", "caption": "a cat"}\n' + "[" * 100_000 + "\n")
    with pytest.raises(DataError) as info:
        read_captions_table(table, tmp_path)
    assert str(info.value) == f"{table}: line 2: field '(json)': JSON nested too deeply to read"
