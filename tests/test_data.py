"""Vocabulary, readers, image loading, data module and samplers."""

from __future__ import annotations

import json
import pickle
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import BatchSampler, DataLoader
from torch.utils.data.distributed import DistributedSampler

from captioning.data.datamodule import (
    BucketBatchSampler,
    CaptionBatch,
    CaptionCollate,
    CaptionDataModule,
    EpochShuffleSampler,
)
from captioning.data.images import ImageLoadError, check_image, load_image, to_rgb
from captioning.data.readers import (
    DataError,
    Problem,
    _has_tokens,
    read_coco_captions,
    read_karpathy,
)
from captioning.vocab import Vocabulary, tokenize

# ------------------------------------------------------------------------------------------
# Vocabulary


def test_vocabulary_round_trip(tmp_path: Path) -> None:
    caps = [tokenize("A dog runs."), tokenize("a dog sits"), tokenize("a cat sits")]
    vocab = Vocabulary.build(caps, min_count=1)
    assert vocab.itos[:4] == ["<pad>", "<start>", "<end>", "<unk>"]
    assert vocab.itos[4:] == ["a", "dog", "sits", "cat", "runs"]  # by count, then alphabet
    ids = vocab.encode(["a", "cat", "flies"])
    assert ids == [vocab.start_id, vocab.stoi["a"], vocab.stoi["cat"], vocab.unk_id,
                   vocab.end_id]
    assert vocab.decode([*ids, vocab.pad_id, vocab.stoi["dog"]]) == ["a", "cat"]
    vocab.save(tmp_path / "v.json")
    assert Vocabulary.load(tmp_path / "v.json") == vocab
    assert Vocabulary.build(caps, min_count=2).itos[4:] == ["a", "dog", "sits"]
    assert len(Vocabulary.build(caps, max_size=6)) == 6


# ------------------------------------------------------------------------------------------
# Readers

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
    assert _has_tokens(text) == bool(tokenize(text))


# ------------------------------------------------------------------------------------------
# Images


def _save(path: Path, im: Image.Image, **kw: Any) -> Path:
    im.save(path, **kw)
    return path


def _rgb_at(path: Path, xy: tuple[int, int] = (0, 0)) -> tuple[int, ...]:
    im = load_image(path)
    assert im.mode == "RGB"
    return im.getpixel(xy)


def test_load_image_converts_every_mode(tmp_path: Path) -> None:
    t = tmp_path
    assert _rgb_at(_save(t / "rgb.png", Image.new("RGB", (3, 2), (10, 20, 30)))) == (10, 20, 30)
    assert _rgb_at(_save(t / "l.png", Image.new("L", (3, 2), 77))) == (77, 77, 77)
    assert _rgb_at(_save(t / "1.png", Image.new("1", (3, 2), 1))) == (255, 255, 255)
    # Alpha is composited over white, for every alpha mode.
    assert _rgb_at(_save(t / "la.png", Image.new("LA", (3, 2), (0, 0)))) == (255, 255, 255)
    assert _rgb_at(_save(t / "rgba0.png", Image.new("RGBA", (3, 2), (255, 0, 0, 0)))) == \
        (255, 255, 255)
    r, g, b = _rgb_at(_save(t / "rgba.png", Image.new("RGBA", (3, 2), (255, 0, 0, 128))))
    assert r == 255 and 120 <= g == b <= 135
    p = Image.new("P", (2, 1))
    p.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    p.putpixel((1, 0), 1)
    _save(t / "p.png", p, transparency=1)
    assert _rgb_at(t / "p.png", (0, 0)) == (255, 0, 0)
    assert _rgb_at(t / "p.png", (1, 0)) == (255, 255, 255)  # transparent index
    q = p.copy()
    q.info.pop("transparency", None)
    assert _rgb_at(_save(t / "p_opaque.png", q), (1, 0)) == (0, 0, 255)
    cmyk = _save(t / "cmyk.tif", Image.new("CMYK", (3, 2), (0, 255, 255, 0)))
    assert Image.open(cmyk).mode == "CMYK"
    assert _rgb_at(cmyk) == (255, 0, 0)
    assert _rgb_at(_save(t / "cmyk.jpg", Image.new("CMYK", (8, 8), (0, 255, 255, 0)))) \
        [0] > 240


def test_high_bit_depth_is_scaled_not_clipped(tmp_path: Path) -> None:
    a16 = np.array([[0, 32896, 65535]], dtype=np.uint16)
    f16 = _save(tmp_path / "i16.png", Image.fromarray(a16))
    assert Image.open(f16).mode == "I;16"
    im = load_image(f16)
    assert [im.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    fi = _save(tmp_path / "i.tif", Image.fromarray(a16.astype(np.int32)))
    assert Image.open(fi).mode == "I"
    assert [load_image(fi).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    fneg = _save(tmp_path / "ineg.tif", Image.fromarray(np.array([[-1000, 0, 1000]],
                                                                  dtype=np.int32)))
    assert [load_image(fneg).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    ff = _save(tmp_path / "f.tif", Image.fromarray(np.array([[0, 0.5, 1.0]], dtype=np.float32)))
    assert Image.open(ff).mode == "F"
    assert [load_image(ff).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    # Modes Pillow may produce in memory convert too.
    for mode in ("I;16B", "YCbCr", "LAB", "HSV", "RGBX", "PA"):
        try:
            im = Image.new(mode, (2, 2))
        except ValueError:
            continue
        assert to_rgb(im).mode == "RGB"


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    f = _save(tmp_path / "rot.jpg", im, exif=exif.tobytes(), quality=95)
    out = load_image(f)
    assert out.size == (20, 40)
    top, bottom = out.getpixel((10, 5)), out.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60
    assert check_image(f) == (20, 40)


@pytest.mark.parametrize("size", [(1, 1), (1, 300), (300, 1)])
def test_tiny_and_extreme_aspect_images(tmp_path: Path, size: tuple[int, int]) -> None:
    f = _save(tmp_path / "x.png", Image.new("RGB", size, (0, 255, 0)))
    assert load_image(f).size == size
    assert check_image(f) == size
    from captioning.data.datamodule import build_image_transform
    x = build_image_transform(16)(load_image(f))
    assert x.shape == (3, 16, 16) and torch.isfinite(x).all()


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("make", "reason"), [
    (lambda d: d / "missing.jpg", "does not exist"),
    (lambda d: _write(d / "empty.jpg", b""), "empty (0 bytes)"),
    (lambda d: _write(d / "text.jpg", b"hello, not an image"), "not an image"),
    (lambda d: _truncate(_save(d / "t.png", Image.effect_noise((64, 64), 50).convert("RGB"))),
     "truncated"),
    (lambda d: _truncate(_save(d / "t.jpg", Image.effect_noise((64, 64), 50).convert("RGB"))),
     "truncated"),
    (lambda d: d, "directory"),
])
def test_bad_files_raise_image_load_error(tmp_path: Path, make: Callable, reason: str) -> None:
    f = make(tmp_path)
    for fn in (load_image, check_image):
        with pytest.raises(ImageLoadError) as info:
            fn(f)
        assert str(f) in str(info.value)
        assert reason in str(info.value)
        assert isinstance(info.value, ValueError)


def test_corrupt_png_is_caught_by_check_image(tmp_path: Path) -> None:
    f = _save(tmp_path / "c.png", Image.effect_noise((32, 32), 40).convert("RGB"))
    data = bytearray(f.read_bytes())
    data[200] ^= 0xFF  # inside IDAT: the chunk CRC no longer matches
    f.write_bytes(bytes(data))
    with pytest.raises(ImageLoadError, match=r"c\.png"):
        check_image(f)


def test_huge_images_get_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _save(tmp_path / "big.png", Image.new("RGB", (64, 64)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for fn in (load_image, check_image):
        with pytest.raises(ImageLoadError, match=r"too large.*MAX_IMAGE_PIXELS"):
            fn(f)


# ------------------------------------------------------------------------------------------
# Data module


@pytest.fixture
def dm(shapes_dm_kwargs: dict[str, Any]) -> CaptionDataModule:
    return CaptionDataModule(**shapes_dm_kwargs)


def test_vocab_is_available_right_after_init(shapes_dm_kwargs: dict, tmp_path: Path) -> None:
    path = tmp_path / "vocab.json"
    dm = CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path))
    tokens = [tokenize(c) for r in dm.records("train") for c in r.captions]
    assert dm.vocab == Vocabulary.build(tokens, min_count=1)
    assert dm.vocab_size == len(dm.vocab) and path.is_file()
    assert Vocabulary.load(path) == dm.vocab
    path.write_text(json.dumps({"words": ["<pad>", "<start>", "<end>", "<unk>", "a"]}))
    assert CaptionDataModule(**shapes_dm_kwargs, vocab_path=str(path)).vocab_size == 5
    small = CaptionDataModule(**shapes_dm_kwargs, min_word_count=1000, max_vocab_size=10)
    assert small.vocab_size == 4


def _check_batch(batch: CaptionBatch, vocab: Vocabulary) -> None:
    lengths = batch.lengths.tolist()
    assert lengths == sorted(lengths, reverse=True)
    assert batch.captions.shape == (len(batch), max(lengths))
    assert batch.captions.dtype == torch.long and batch.lengths.dtype == torch.long
    for row, n in zip(batch.captions, lengths):
        assert row[0] == vocab.start_id and row[n - 1] == vocab.end_id
        assert (row[n:] == vocab.pad_id).all()
        assert (row[:n] != vocab.pad_id).all()


def test_train_batches(dm: CaptionDataModule) -> None:
    dm.setup("fit")
    loader = dm.train_dataloader()
    batches = list(loader)
    assert len(batches) == len(loader) == 30  # 24 images x 5 captions / 4
    pairs = []
    for batch in batches:
        assert isinstance(batch, CaptionBatch)
        assert batch.images.shape == (len(batch), 3, 64, 64)
        _check_batch(batch, dm.vocab)
        for row, refs, image_id in zip(batch.captions, batch.references, batch.image_ids):
            assert len(refs) == 1
            assert dm.vocab.decode(row.tolist()) == tokenize(refs[0])
            pairs.append((image_id, refs[0]))
    expected = [(r.image_id, c) for r in dm.records("train") for c in r.captions]
    assert sorted(pairs) == sorted(expected)


def test_eval_batches_carry_all_references(dm: CaptionDataModule) -> None:
    dm.setup("validate")
    by_id = {r.image_id: r for r in dm.records("val")}
    seen = []
    for batch in dm.val_dataloader():
        _check_batch(batch, dm.vocab)
        for row, refs, image_id in zip(batch.captions, batch.references, batch.image_ids):
            assert tuple(refs) == by_id[image_id].captions and len(refs) == 5
            assert dm.vocab.decode(row.tolist()) == tokenize(refs[0])
            seen.append(image_id)
    assert sorted(seen) == sorted(by_id)
    dm.setup("test")
    assert sum(len(b) for b in dm.test_dataloader()) == 8


def test_images_are_normalised(dm: CaptionDataModule) -> None:
    x = dm.image_transform(train=False)(Image.new("RGB", (10, 20), (124, 116, 104)))
    assert x.shape == (3, 64, 64)
    assert x.abs().max() < 0.01  # ImageNet mean maps to ~0


def test_max_caption_length_truncates(shapes_dm_kwargs: dict) -> None:
    dm = CaptionDataModule(**shapes_dm_kwargs, max_caption_length=3)
    dm.setup("fit")
    batch = next(iter(dm.train_dataloader()))
    assert batch.lengths.max() == 5  # <start> + 3 words + <end>
    row = batch.captions[0].tolist()
    assert dm.vocab.decode(row) == tokenize(batch.references[0][0])[:3]


def test_collate_handles_feature_tensors() -> None:
    items = [(torch.randn(7, 5), torch.tensor([1, 4, 2]), "a", ["x"]),
             (torch.randn(7, 5), torch.tensor([1, 4, 5, 6, 2]), "b", ["y z"])]
    batch = CaptionCollate(pad_id=0)(items)
    assert batch.images.shape == (2, 7, 5)
    assert batch.image_ids == ["b", "a"] and batch.lengths.tolist() == [5, 3]
    assert batch.captions.tolist() == [[1, 4, 5, 6, 2], [1, 4, 2, 0, 0]]
    assert torch.equal(batch.images[0], items[1][0])


def test_datasets_pickle_for_workers(dm: CaptionDataModule) -> None:
    dm.setup("fit")
    ds = dm.train_dataloader().dataset
    clone = pickle.loads(pickle.dumps(ds))
    assert torch.equal(clone[3][1], ds[3][1]) and torch.equal(clone[3][0], ds[3][0])


def test_boxes_and_records(dm: CaptionDataModule, shapes_root: Path) -> None:
    assert dm.boxes is not None and len(dm.boxes) == 40
    assert {len(dm.records(s)) for s in ("train", "val", "test")} == {24, 8}
    karpathy = CaptionDataModule(dataset="karpathy",
                                 split_file=str(shapes_root / "dataset_shapes.json"))
    assert karpathy.boxes is None
    assert karpathy.records("val") == dm.records("val")


def test_coco_mode_carves_val_and_test(shapes_root: Path) -> None:
    ann, images = shapes_root / "annotations", str(shapes_root / "images")
    full = CaptionDataModule(dataset="coco", train_annotations=str(ann / "captions_train.json"),
                             train_images=images, val_annotations=str(ann / "captions_val.json"),
                             val_images=images, test_annotations=str(ann / "captions_test.json"),
                             test_images=images, image_size=32)
    assert [len(full.records(s)) for s in ("train", "val", "test")] == [24, 8, 8]
    kwargs = {"dataset": "coco", "train_annotations": str(ann / "captions_train.json"),
              "train_images": images, "image_size": 32}
    a, b = CaptionDataModule(**kwargs), CaptionDataModule(**kwargs, seed=5)
    ids = {s: [r.image_id for r in a.records(s)] for s in ("train", "val", "test")}
    assert len(ids["val"]) == len(ids["test"]) == 4 and len(ids["train"]) == 16
    assert not set(ids["val"]) & set(ids["test"]) and not set(ids["train"]) & set(ids["val"])
    assert {r.split for r in a.records("test")} == {"test"}
    assert ids == {s: [r.image_id for r in b.records(s)] for s in ids}  # seed-independent
    a.setup("test")
    assert sum(len(batch) for batch in a.test_dataloader()) == 4


def _copy_with_bad_image(shapes_root: Path, tmp_path: Path) -> Path:
    root = tmp_path / "copy"
    shutil.copytree(shapes_root, root)
    (root / "images" / "train_00003.png").write_bytes(b"not a png")
    return root


def test_bad_image_file_fails_or_is_skipped(shapes_dm_kwargs: dict, shapes_root: Path,
                                            tmp_path: Path) -> None:
    root = _copy_with_bad_image(shapes_root, tmp_path)
    kwargs = {**shapes_dm_kwargs, "root": str(root)}
    with pytest.raises(DataError, match=r"train_00003\.png.*field 'image'.*not an image"):
        CaptionDataModule(**kwargs).setup("fit")
    dm = CaptionDataModule(**kwargs, on_bad_data="skip")
    vocab_before = dm.vocab
    dm.setup("fit")
    assert dm.skipped == {"captions": 0, "images": 0, "image_files": 1}
    assert len(dm.records("train")) == 23
    assert len(dm.train_dataloader().dataset) == 23 * 5
    assert dm.vocab is vocab_before


def test_skipped_annotations_are_counted(shapes_dm_kwargs: dict, shapes_root: Path,
                                         tmp_path: Path) -> None:
    root = tmp_path / "copy"
    shutil.copytree(shapes_root, root)
    f = root / "dataset_shapes.json"
    data = json.loads(f.read_text())
    data["images"][0]["sentences"][1]["raw"] = " "
    data["images"][2]["split"] = "holdout"
    f.write_text(json.dumps(data))
    kwargs = {**shapes_dm_kwargs, "dataset": "karpathy", "split_file": str(f)}
    with pytest.raises(DataError, match="holdout"):
        _ = CaptionDataModule(**kwargs).vocab
    dm = CaptionDataModule(**kwargs, on_bad_data="skip")
    assert len(dm.records("train")) == 23
    assert dm.skipped == {"captions": 1, "images": 1, "image_files": 0}
    assert len(dm.records("train")[0].captions) == 4


def test_unbucketed_loader(shapes_dm_kwargs: dict) -> None:
    dm = CaptionDataModule(**shapes_dm_kwargs, length_bucketing=False)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert sum(len(b) for b in batches) == 120
    for b in batches:
        _check_batch(b, dm.vocab)


# ------------------------------------------------------------------------------------------
# Samplers


def _lengths(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 20, size=n)


def test_bucket_sampler_covers_each_item_once_per_epoch() -> None:
    lengths = _lengths(103)
    inner = EpochShuffleSampler(103, seed=1)
    sampler = BucketBatchSampler(inner, 8, lengths=lengths, seed=1, bucket_size_multiplier=4)
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        batches = list(sampler)
        assert len(batches) == len(sampler) == 13
        flat = [i for b in batches for i in b]
        assert sorted(flat) == list(range(103))
        for b in batches:  # each batch is a run of a length-sorted pool
            assert list(lengths[b]) == sorted(lengths[b], reverse=True)
        epochs.append(batches)
    assert epochs[0] != epochs[1]
    sampler.set_epoch(1)
    assert list(sampler) == epochs[1]  # deterministic given (seed, epoch)
    # Bucketing groups similar lengths: far less spread than random batches.
    spread = np.mean([np.ptp(lengths[b]) for b in epochs[0] if len(b) == 8])
    assert spread < 6


def test_bucket_sampler_drop_last() -> None:
    sampler = BucketBatchSampler(range(21), 4, True, lengths=_lengths(21),
                                 bucket_size_multiplier=2)
    batches = list(sampler)
    assert len(batches) == len(sampler) == 5 and all(len(b) == 4 for b in batches)


def test_bucket_sampler_shards_disjointly_across_replicas() -> None:
    n, lengths = 100, _lengths(100)
    shards = []
    for rank in range(2):
        inner = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler = BucketBatchSampler(inner, 6, lengths=lengths, bucket_size_multiplier=3)
        sampler.set_epoch(2)
        assert inner.epoch == 2
        batches = list(sampler)
        assert len(batches) == len(sampler)
        shards.append([i for b in batches for i in b])
    assert len(list(BucketBatchSampler(DistributedSampler(range(n), num_replicas=2, rank=0),
                                       6, lengths=lengths))) == len(sampler)
    assert not set(shards[0]) & set(shards[1])
    assert sorted(shards[0] + shards[1]) == list(range(n))


def test_lightning_injects_a_distributed_sampler(dm: CaptionDataModule) -> None:
    """Under DDP Lightning rebuilds the batch sampler around a DistributedSampler."""
    from lightning.fabric.utilities.data import _replace_dunder_methods, _set_sampler_epoch
    from lightning.pytorch.utilities.data import _is_dataloader_shuffled, _update_dataloader

    dm.setup("fit")
    with _replace_dunder_methods(DataLoader, "dataset"), _replace_dunder_methods(BatchSampler):
        loader = dm.train_dataloader()
    assert _is_dataloader_shuffled(loader)
    seen: list[int] = []
    for rank in range(2):
        dist = DistributedSampler(loader.dataset, num_replicas=2, rank=rank, shuffle=True)
        new = _update_dataloader(loader, dist)
        assert isinstance(new.batch_sampler, BucketBatchSampler)
        assert new.batch_sampler.sampler is dist
        _set_sampler_epoch(new, 4)
        assert new.batch_sampler.epoch == 4
        seen += [i for b in new.batch_sampler for i in b]
    assert sorted(seen) == list(range(len(loader.dataset)))


def test_rgba_palette_and_jpeg_draft(tmp_path: Path) -> None:
    p = Image.new("P", (2, 1))
    p.putpalette(bytes([255, 0, 0, 255, 0, 0, 255, 0]) + bytes(1016), "RGBA")
    p.putpixel((1, 0), 1)
    assert to_rgb(p).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(p).getpixel((1, 0)) == (255, 255, 255)  # alpha 0 in the palette
    f = _save(tmp_path / "big.jpg", Image.new("RGB", (400, 240), (0, 128, 0)))
    small = load_image(f, min_side=50)
    assert min(small.size) >= 50 and small.size[0] < 400  # decoded at a reduced scale
    assert load_image(f).size == (400, 240)
