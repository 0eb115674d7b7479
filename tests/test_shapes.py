"""The synthetic shapes dataset: determinism, caching, captions and object parsing."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from conftest import boxes_table
from PIL import Image

from captioning.data.readers import read_coco_captions, read_karpathy
from captioning.data.shapes import (
    COLOR_RGB,
    COLORS,
    DEFAULT_PARAMS,
    SHAPES,
    SIZES,
    bound_colour,
    generate_shapes,
    parse_objects,
    scene_objects,
)
from captioning.vocab import tokenize

TINY = {"num_train": 5, "num_val": 2, "num_test": 2, "image_size": 32}


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file()}


def test_same_seed_gives_identical_files_and_other_seed_differs(tmp_path: Path) -> None:
    a = _files(generate_shapes(tmp_path / "a", seed=3, **TINY))
    b = _files(generate_shapes(tmp_path / "b", seed=3, **TINY))
    c = _files(generate_shapes(tmp_path / "c", seed=4, **TINY))
    assert a == b
    assert len(a) == 9 + 6  # images + dataset json + 3 annotation files + boxes + manifest
    assert a.keys() == c.keys()
    differing = [k for k in a if k.endswith(".png") and a[k] != c[k]]
    assert len(differing) == 9


def test_generation_is_cached_and_regenerated_on_new_params(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "s", seed=0, **TINY)
    png = root / "images" / "train_00000.png"
    stamp = png.stat().st_mtime_ns
    generate_shapes(root, seed=0, **TINY)
    assert png.stat().st_mtime_ns == stamp  # cached: nothing rewritten
    generate_shapes(root, seed=0, **{**TINY, "num_train": 3})
    manifest = json.loads((root / "manifest.json").read_text())
    assert manifest["num_train"] == 3
    assert len(list((root / "images").glob("train_*.png"))) == 3
    # No temporary or old directories are left next to the dataset.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]


def test_a_generator_killed_between_its_renames_leaves_nothing_behind(tmp_path: Path) -> None:
    """Killed after setting the old dataset aside and before moving the new one in: the next
    generation removes both folders the dead process left (they carry its PID)."""
    import subprocess
    import sys

    root = generate_shapes(tmp_path / "s", seed=0, **TINY)
    child = (
        "import os, sys\n"
        "import captioning.data.shapes as shapes\n"
        "real = os.rename\n"
        "def rename(src, dst):\n"
        "    if str(dst) == sys.argv[1]:\n"
        "        os._exit(9)  # the kill, after the old dataset was renamed away\n"
        "    real(src, dst)\n"
        "shapes.os.rename = rename\n"
        f"shapes.generate_shapes(sys.argv[1], seed=1, **{TINY!r})\n")
    assert subprocess.run([sys.executable, "-c", child, str(root)]).returncode == 9
    left = sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock")
    assert len(left) == 2 and all(p.endswith(".tmp") for p in left)  # old and new, aside
    generate_shapes(root, seed=1, **TINY)
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix != ".lock") == ["s"]


def test_incomplete_dataset_is_regenerated(tmp_path: Path) -> None:
    root = generate_shapes(tmp_path / "s", seed=0, **TINY)
    (root / "images" / "val_00001.png").unlink()
    generate_shapes(root, seed=0, **TINY)
    assert (root / "images" / "val_00001.png").is_file()


def test_refuses_to_overwrite_foreign_directory(tmp_path: Path) -> None:
    root = tmp_path / "mine"
    root.mkdir()
    (root / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match=r"not a shapes dataset \(no manifest.json\)"):
        generate_shapes(root, **TINY)
    assert (root / "notes.txt").read_text() == "keep me"
    (root / "manifest.json").write_text('{"seed": ')  # a truncated manifest: said so
    with pytest.raises(FileExistsError, match=r"its manifest\.json is unreadable, perhaps damaged"):
        generate_shapes(root, **TINY)
    assert (root / "notes.txt").read_text() == "keep me"


def test_layouts_and_captions(shapes_root: Path) -> None:
    data = json.loads((shapes_root / "dataset_shapes.json").read_text())
    boxes = boxes_table(shapes_root / "boxes.json")
    images = data["images"]
    assert [im["split"] for im in images].count("train") == 24
    assert len(boxes) == len(images) == 40
    vocab = set()
    for im in images:
        raws = [s["raw"] for s in im["sentences"]]
        assert len(raws) == 5 and len(set(raws)) == 5
        for s in im["sentences"]:
            assert s["tokens"] == tokenize(s["raw"])
            vocab.update(s["tokens"])
        img = Image.open(shapes_root / im["filepath"] / im["filename"])
        assert img.size == (64, 64) and img.mode == "RGB"
    assert len(vocab) < 60  # a small vocabulary

    # The raw COCO files hold the same captions under the same ids.
    karpathy = {r.image_id: r.captions for r in read_karpathy(
        shapes_root / "dataset_shapes.json", shapes_root)}
    seen = []
    for split in ("train", "val", "test"):
        recs = read_coco_captions(shapes_root / "annotations" / f"captions_{split}.json",
                                  shapes_root / "images", split=split)
        for r in recs:
            assert r.captions == karpathy[r.image_id]
            assert r.path.is_file()
        seen += [r.image_id for r in recs]
    assert sorted(seen) == sorted(karpathy)  # every image once, in one split


def test_canonical_caption_names_every_object_left_to_right(shapes_root: Path) -> None:
    data = json.loads((shapes_root / "dataset_shapes.json").read_text())
    boxes = boxes_table(shapes_root / "boxes.json")
    counts = set()
    for im in data["images"]:
        objs = boxes[im["cocoid"]]
        counts.add(len(objs))
        canonical = im["sentences"][0]["raw"]
        assert parse_objects(canonical) == scene_objects(objs)
        for s in im["sentences"]:  # every variant names only objects that are there
            assert parse_objects(s["raw"]) <= scene_objects(objs)
        left_to_right = sorted(objs, key=lambda o: o["bbox"][0] + o["bbox"][2] / 2)
        expected = " to the left of ".join(f"a {o['size']} {o['color']} {o['shape']}"
                                           for o in left_to_right)
        assert canonical == expected
    assert counts == {1, 2, 3}


def test_boxes_are_inside_the_image_and_do_not_overlap(shapes_root: Path) -> None:
    data = json.loads((shapes_root / "boxes.json").read_text())
    assert len(data["images"]) == 40
    for entry in data["images"]:
        assert set(entry) == {"image_id", "file_name", "width", "height", "objects"}
        rects = []
        for o in entry["objects"]:
            assert o["color"] in COLORS and o["shape"] in SHAPES and o["size"] in SIZES
            x, y, w, h = o["bbox"]
            assert x >= 0 and y >= 0 and x + w <= entry["width"] and y + h <= entry["height"]
            rects.append((x, y, x + w, y + h))
        for i, a in enumerate(rects):
            for b in rects[i + 1:]:
                assert a[2] <= b[0] or b[2] <= a[0] or a[3] <= b[1] or b[3] <= a[1]


def test_objects_are_drawn_in_their_colour(shapes_root: Path) -> None:
    data = json.loads((shapes_root / "boxes.json").read_text())
    assert len(data["images"]) == 40
    for entry in data["images"][:10]:
        arr = np.asarray(Image.open(shapes_root / "images" / entry["file_name"]), dtype=float)
        for o in entry["objects"]:
            x, y, w, h = o["bbox"]
            cx, cy = int(x + w / 2), int(y + h * 0.6)  # inside every shape (incl. triangles)
            centre = arr[cy - 1: cy + 2, cx - 1: cx + 2].reshape(-1, 3).mean(0)
            dists = {c: np.linalg.norm(centre - np.array(rgb)) for c, rgb in COLOR_RGB.items()}
            assert min(dists, key=dists.get) == o["color"]


@pytest.mark.parametrize(("caption", "expected"), [
    ("a large red circle to the left of a small blue square",
     {("red", "circle"), ("blue", "square")}),
    ("There are two Red Circles and a green triangle.", {("red", "circle"),
                                                        ("green", "triangle")}),
    ("a red large diamond", {("red", "diamond")}),
    ("a red and blue square", {("blue", "square")}),  # "red" is not bound to a shape
    ("a red thing near a circle", set()),
    ("a red small large circle", set()),  # one size word at most between them
    ("a red circle square", {("red", "circle")}),  # the colour binds to one noun
    ("a red large blue circle", {("blue", "circle")}),
    ("", set()),
])
def test_parse_objects(caption: str, expected: set[tuple[str, str]]) -> None:
    assert parse_objects(caption) == expected


@pytest.mark.parametrize(("tokens", "t", "expected"), [
    (["a", "blue", "cube"], 2, "blue"),
    (["blue", "big", "cube"], 2, "blue"),
    (["blue", "big", "big", "cube"], 3, None),
    (["big", "cube"], 1, None),  # a size word with nothing before it
    (["cube"], 0, None),
    (["blue", "and", "cube"], 2, None),
])
def test_bound_colour_is_one_rule_over_any_words(tokens: list[str], t: int,
                                                 expected: str | None) -> None:
    """The binding of pointing accuracy (any object, colour and size words) and of
    `parse_objects`: the colour right before the noun, or before one size word."""
    assert bound_colour(tokens, t, colours={"blue"}, sizes={"big"}) == expected


def test_scene_objects_accepts_entry_or_object_list() -> None:
    objs = [{"color": "red", "shape": "circle", "size": "small", "bbox": [0, 0, 1, 1]}]
    assert scene_objects(objs) == scene_objects({"objects": objs}) == {("red", "circle")}


def test_every_default_names_one_dataset(monkeypatch: pytest.MonkeyPatch) -> None:
    """`captioning shapes`, `ShapesSource()` and configs/data/shapes.yaml ask for one dataset,
    so that `fit --config data/shapes` after `captioning shapes` uses it (a dataset of other
    parameters would be generated again in its place)."""
    import yaml

    import captioning.data.shapes as shapes_module
    from captioning.commands import shapes as command
    from captioning.commands.configs import CONFIG_DIR
    from captioning.data.sources import ShapesSource

    written: dict = {}
    monkeypatch.setattr(shapes_module, "generate_shapes",
                        lambda root, **kw: written.update(root=str(root), **kw) or Path(root))
    assert command.main([]) == 0
    source = ShapesSource()
    assert written == {"root": str(source.root), **source.params}
    init_args = yaml.safe_load((CONFIG_DIR / "data" / "shapes.yaml").read_text())["data"]["source"]["init_args"]
    assert ShapesSource(**init_args) == source


def test_the_shapes_command_shows_its_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    """`captioning shapes --help` gives each setting's default: the sizes `fit --config
    data/shapes` reads (`DEFAULT_PARAMS`)."""
    from captioning.commands.shapes import main

    with pytest.raises(SystemExit):
        main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for name, value in DEFAULT_PARAMS.items():  # each default right after its own flag
        flag = name.replace("_", "-")
        assert re.search(rf"--{flag} {name.upper()} [^-(]*\(default: {value}\)", text), name
