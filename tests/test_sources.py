"""Data sources: records of each source, COCO carving, cache roots, grounding (ObjectBoxes) and
the class_path form LightningCLI reads."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import SHAPES_PARAMS, boxes_table, shapes_cli_args, shapes_source

from captioning.data import carving, sources
from captioning.data.datamodule import CaptionDataModule
from captioning.data.problems import DataError
from captioning.data.shapes import (
    COLORS,
    SHAPES,
    SIZES,
    parse_objects,
    scene_objects,
)
from captioning.data.sources import (
    CocoCaptions,
    DataSource,
    KarpathySplits,
    ObjectBoxes,
    ShapesSource,
)
from captioning.data.transforms import boxes_to_crop_coords


@pytest.fixture
def dm(shapes_dm_kwargs: dict[str, Any]) -> CaptionDataModule:
    return CaptionDataModule(**shapes_dm_kwargs)


def _coco(shapes_root: Path, *splits: str, **kwargs: Any) -> CocoCaptions:
    """The shapes dataset's raw COCO files of `splits` as a CocoCaptions source."""
    ann, images = shapes_root / "annotations", str(shapes_root / "images")
    files = {f"{s}_annotations": str(ann / f"captions_{s}.json") for s in splits}
    return CocoCaptions(**files, **{f"{s}_images": images for s in splits}, **kwargs)


# ------------------------------------------------------------------------------------------
# Records


def test_boxes_and_records(dm: CaptionDataModule, shapes_root: Path) -> None:
    assert dm.boxes is not None and len(dm.boxes) == 40
    assert {len(dm.records(s)) for s in ("train", "val", "test")} == {24, 8}
    karpathy = CaptionDataModule(
        source=KarpathySplits(split_file=str(shapes_root / "dataset_shapes.json")))
    assert karpathy.boxes is None
    assert karpathy.records("val") == dm.records("val")


def test_coco_mode_carves_val_and_test(shapes_root: Path) -> None:
    full = CaptionDataModule(source=_coco(shapes_root, "train", "val", "test"), image_size=32)
    assert [len(full.records(s)) for s in ("train", "val", "test")] == [24, 8, 8]
    source = _coco(shapes_root, "train")
    a = CaptionDataModule(source=source, image_size=32)
    b = CaptionDataModule(source=source, image_size=32, seed=5)
    ids = {s: [r.image_id for r in a.records(s)] for s in ("train", "val", "test")}
    assert len(ids["val"]) == len(ids["test"]) == 4 and len(ids["train"]) == 16
    assert not set(ids["val"]) & set(ids["test"]) and not set(ids["train"]) & set(ids["val"])
    assert {r.split for r in a.records("test")} == {"test"}
    assert ids == {s: [r.image_id for r in b.records(s)] for s in ids}  # seed-independent
    a.setup("test")
    assert sum(len(batch) for batch in a.test_dataloader()) == 4


def test_each_source_reads_the_same_shapes_records(shapes_root: Path) -> None:
    shapes = shapes_source(shapes_root).read()
    assert [len(shapes.splits[s]) for s in ("train", "val", "test")] == [24, 8, 8]
    assert shapes.problems == [] and shapes.skipped_images == shapes.skipped_captions == 0
    karpathy = KarpathySplits(split_file=str(shapes_root / "dataset_shapes.json")).read()
    assert karpathy.splits == shapes.splits
    coco = _coco(shapes_root, "train", "val", "test").read()
    for split in ("train", "val", "test"):
        assert {(r.image_id, r.path, r.captions) for r in coco.splits[split]} == \
            {(r.image_id, r.path, r.captions) for r in shapes.splits[split]}


def test_merge_restval_belongs_to_karpathy(tmp_path: Path, write_karpathy: Callable) -> None:
    specs = [{"id": i, "filename": f"{i}.jpg", "split": s, "captions": ["a dog"]}
             for i, s in enumerate(["train", "restval", "val", "test"])]
    f = write_karpathy(tmp_path / "k.json", specs)
    merged = CaptionDataModule(source=KarpathySplits(split_file=str(f)))
    assert [r.image_id for r in merged.records("train")] == [0, 1]
    kept = CaptionDataModule(source=KarpathySplits(split_file=str(f), merge_restval=False))
    assert [r.image_id for r in kept.records("train")] == [0]
    assert [r.image_id for r in kept.records("restval")] == [1]
    assert merged.records("train")[0].path == tmp_path / "train2014" / "0.jpg"  # file's folder
    other = KarpathySplits(split_file=str(f), image_root=str(tmp_path / "imgs")).read()
    assert other.splits["val"][0].path == tmp_path / "imgs" / "train2014" / "2.jpg"


def test_skip_counts_come_from_the_source(tmp_path: Path, write_coco: Callable) -> None:
    f = write_coco(tmp_path / "c.json", [(i, f"{i}.jpg") for i in range(10)],
                   [(i, "a dog") for i in range(10)] + [(3, "?"), (42, "a cat")])
    got = CocoCaptions(train_annotations=str(f), train_images=str(tmp_path)).read("skip")
    assert got.skipped_captions == 2 and got.skipped_images == 0 and len(got.problems) == 2
    assert [len(got.splits[s]) for s in ("train", "val", "test")] == [6, 2, 2]
    dm = CaptionDataModule(source=CocoCaptions(train_annotations=str(f),
                                               train_images=str(tmp_path)), on_bad_data="skip")
    assert len(dm.records("train")) == 6
    assert dm.skipped == {"captions": 2, "images": 0, "image_files": 0}
    assert dm.problems == got.problems


# ------------------------------------------------------------------------------------------
# Carving


def test_coco_carves_test_out_of_val_and_honours_carve_size(shapes_root: Path) -> None:
    got = _coco(shapes_root, "train", "val").read()
    assert [len(got.splits[s]) for s in ("train", "val", "test")] == [24, 7, 1]  # 8 // 5
    assert got.carved == ()  # out of val: no training image is involved (nor a checkpoint's)
    assert _coco(shapes_root, "train").read().carved == ("val", "test")
    assert {r.split for r in got.splits["test"]} == {"test"}
    small = _coco(shapes_root, "train", carve_size=2).read()
    assert [len(small.splits[s]) for s in ("train", "val", "test")] == [20, 2, 2]
    again = _coco(shapes_root, "train", carve_size=2).read()
    assert small.splits == again.splits


def test_carving_goes_by_each_images_id_alone() -> None:
    """Dropping or adding an image moves at most one image across each boundary, and never a
    training image into test: a run that skipped an entry at fit and a later test with it
    fixed carve the same test images but one. Test takes the first ranks, val the next."""
    from captioning.data.readers import ImageRecord

    records = [ImageRecord(i, Path(f"{i}.jpg"), "train", ("a dog",)) for i in range(1000)]
    rest, carved = carving.carve(records, {"val": 100, "test": 100})
    ids = {s: {r.image_id for r in v} for s, v in {**carved, "train": rest}.items()}
    assert [len(ids[s]) for s in ("train", "val", "test")] == [800, 100, 100]
    assert [r.image_id for r in rest] == sorted(ids["train"])  # the source's order kept
    ranked = sorted(range(1000), key=carving.carve_rank)
    assert set(ranked[:100]) == ids["test"] and set(ranked[100:200]) == ids["val"]
    for dropped in (next(iter(ids["test"])), next(iter(ids["val"])), next(iter(ids["train"]))):
        _, now = carving.carve([r for r in records if r.image_id != dropped],
                               {"val": 100, "test": 100})
        test = {r.image_id for r in now["test"]}
        assert test <= ids["test"] | ids["val"] and len(test - ids["test"]) <= 1
        assert len({r.image_id for r in now["val"]} - ids["val"]) <= 1
    shuffled = records[::-1]
    assert {s: [r.image_id for r in v] for s, v in carving.carve(shuffled, {"test": 5})[1]
            .items()} == {"test": sorted(ids["test"], key=carving.carve_rank)[:5]}


def test_too_few_val_images_to_carve_test_names_the_val_file_and_why(
        tmp_path: Path, write_coco: Callable) -> None:
    train = write_coco(tmp_path / "train.json", [(i, f"{i}.jpg") for i in range(10)],
                       [(i, "a dog") for i in range(10)])
    val = write_coco(tmp_path / "val.json", [(100 + i, f"v{i}.jpg") for i in range(3)], [])
    source = CocoCaptions(train_annotations=str(train), train_images=str(tmp_path),
                          val_annotations=str(val), val_images=str(tmp_path))
    with pytest.raises(DataError) as e:
        source.read(on_error="skip")
    (problem,) = e.value.problems
    assert (problem.file, problem.entry, problem.field) == (str(val), "(splits)", "test")
    assert problem.message == (
        "cannot carve test out of 0 val images (3 problems left entries out, the first: "
        "images[0] (id 100): field 'annotations': image has no usable captions)")


def test_a_checkpoint_carved_by_another_rule_is_refused_on_the_same_source_only() -> None:
    source = CocoCaptions(train_annotations="a/train.json", train_images="a/img")
    saved = {"source": source.config(), "batch_size": 8}
    problem = carving.carving_problem(saved, None, source, ("val", "test"))
    assert problem is not None and (problem.file, problem.entry, problem.field) == (
        "a/train.json", "(splits)", "val/test")
    assert carving.carving_problem(saved, carving.CARVING, source, ("val", "test")) is None
    assert carving.carving_problem(saved, None, source, ()) is None  # nothing carved now
    other = CocoCaptions(train_annotations="b/train.json", train_images="b/img")
    assert carving.carving_problem(saved, None, other, ("val", "test")) is None
    spelled = CocoCaptions(train_annotations=str(Path("a/train.json").resolve()),
                           train_images="a/img", carve_size=100)  # the same file, other args
    assert carving.carving_problem(saved, None, spelled, ("val", "test")) is not None
    assert carving.carving_problem(None, None, source, ("val", "test")) is None


def test_carving_needs_five_images(tmp_path: Path, write_coco: Callable) -> None:
    f = write_coco(tmp_path / "c.json", [(i, f"{i}.jpg") for i in range(4)],
                   [(i, "a dog") for i in range(4)])
    with pytest.raises(ValueError, match="cannot carve val and test out of 4 train images"):
        CocoCaptions(train_annotations=str(f), train_images=str(tmp_path)).read()


def test_carving_ignores_file_order(tmp_path: Path, write_coco: Callable) -> None:
    images = [(i, f"{i}.jpg") for i in range(20)]
    caps = [(i, f"a dog number {i}") for i in range(20)]
    a = write_coco(tmp_path / "a.json", images, caps)
    b = write_coco(tmp_path / "b.json", images[::-1], caps[::-1])
    ids = [{s: sorted(r.image_id for r in rs) for s, rs in
            CocoCaptions(train_annotations=str(f), train_images=str(tmp_path)).read()
            .splits.items()} for f in (a, b)]
    assert ids[0] == ids[1] and len(ids[0]["val"]) == 4


# ------------------------------------------------------------------------------------------
# Arguments, cache roots, messages


@pytest.mark.parametrize(("make", "words"), [
    (lambda: KarpathySplits(split_file=""), "split_file"),
    (lambda: CocoCaptions(train_annotations="", train_images="x"), "train_annotations"),
    (lambda: CocoCaptions(train_annotations="a.json", train_images=""), "train_images"),
    (lambda: CocoCaptions(train_annotations="a.json", train_images="x",
                          val_annotations="v.json"), "val_annotations is set but val_images"),
    (lambda: CocoCaptions(train_annotations="a.json", train_images="x",
                          test_annotations="t.json"), "test_annotations is set but test_images"),
    (lambda: ShapesSource(num_train=-1), "num_train must be >= 0"),
    (lambda: ShapesSource(image_size=8), "image_size must be >= 16"),
])
def test_constructors_name_the_bad_argument(make: Callable[[], Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        make()


def test_cache_root_and_describe(tmp_path: Path) -> None:
    shapes = ShapesSource(root=str(tmp_path / "s"))
    assert shapes.cache_root() == tmp_path / "s" / "features"
    assert shapes.describe("val") == str(tmp_path / "s" / "dataset_shapes.json")
    karpathy = KarpathySplits(split_file=str(tmp_path / "k" / "dataset_coco.json"),
                              image_root=str(tmp_path / "images"))
    assert karpathy.cache_root() == tmp_path / "k" / "features"
    assert karpathy.describe("test") == str(tmp_path / "k" / "dataset_coco.json")
    coco = CocoCaptions(train_annotations=str(tmp_path / "ann" / "train.json"),
                        train_images=str(tmp_path / "train"),
                        val_annotations=str(tmp_path / "ann2" / "val.json"),
                        val_images=str(tmp_path / "val"))
    assert coco.cache_root() == tmp_path / "ann" / "features"
    assert coco.describe("val") == str(tmp_path / "ann2" / "val.json")
    assert coco.describe("test") == str(tmp_path / "ann" / "train.json")  # carved
    dm = CaptionDataModule(source=karpathy)
    assert dm.cache_root() == karpathy.cache_root()
    dm = CaptionDataModule(source=karpathy, cache_dir=str(tmp_path / "cache"))
    assert dm.cache_root() == tmp_path / "cache"


def test_defaults_and_min_word_count() -> None:
    dm = CaptionDataModule()
    assert dm.source == ShapesSource(root="data/shapes", num_train=4000, num_val=250,
                                     num_test=500, image_size=128, seed=0)
    assert dm.min_word_count == 1
    karpathy = KarpathySplits(split_file="x.json")
    assert CaptionDataModule(source=karpathy).min_word_count == 5
    assert CaptionDataModule(source=karpathy, min_word_count=2).min_word_count == 2
    with pytest.raises(TypeError, match="DataSource"):
        CaptionDataModule(source={"class_path": "x"})  # type: ignore[arg-type]


def test_empty_split_names_the_source_file(tmp_path: Path, write_karpathy: Callable,
                                           write_png: Callable) -> None:
    specs = [{"id": i, "filename": f"{i}.png", "split": "train", "captions": ["a dog"]}
             for i in range(3)]
    f = write_karpathy(tmp_path / "k.json", specs, layout="flickr")
    for i in range(3):
        write_png(tmp_path / f"{i}.png")
    dm = CaptionDataModule(source=KarpathySplits(split_file=str(f)), min_word_count=1,
                           image_size=8)
    with pytest.raises(Exception, match=r"k\.json: val split: field 'split'.*no usable images"):
        dm.setup("validate")


# ------------------------------------------------------------------------------------------
# Grounding


def _old_crop_boxes(path: Path, image_ids: list[Any], size: int) -> list[list[dict]]:
    """CaptionDataModule.crop_boxes as it was: boxes.json read twice, then mapped."""
    boxes = boxes_table(path)
    data = json.loads(path.read_text(encoding="utf-8"))
    sizes = {e["image_id"]: (int(e["width"]), int(e["height"])) for e in data["images"]}
    out = []
    for i in image_ids:
        w, h = sizes[i]
        out.append([{**o, "bbox": list(boxes_to_crop_coords(o["bbox"], w, h, size=size))}
                    for o in boxes[i]])
    return out


def test_object_boxes_of_shapes(shapes_root: Path) -> None:
    g = shapes_source(shapes_root).grounding()
    assert isinstance(g, ObjectBoxes)
    table = boxes_table(shapes_root / "boxes.json")
    assert g.table == table and len(g) == 40 and list(g.ids) == list(table)
    assert 0 in g and 39 in g and 40 not in g and "0" not in g
    for i in g.ids:
        assert g.objects(i) == scene_objects(table[i])
    data = json.loads((shapes_root / "dataset_shapes.json").read_text())
    for im in data["images"]:
        for s in im["sentences"]:
            assert g.parse(s["raw"]) == parse_objects(s["raw"])
    assert (g.object_words, g.color_words, g.modifier_words) == (SHAPES, COLORS, SIZES)
    ids = list(g.ids)[::3]
    for size in (64, 48, 100):
        assert g.crop_boxes(ids, size) == _old_crop_boxes(shapes_root / "boxes.json", ids, size)


def test_crop_boxes_of_non_square_images(tmp_path: Path) -> None:
    objects = [{"color": "red", "shape": "circle", "size": "small", "bbox": [50, 10, 20, 30]},
               {"color": "blue", "shape": "square", "size": "large", "bbox": [0, 0, 40, 40]}]
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"images": [
        {"image_id": "a", "width": 200, "height": 100, "objects": objects},
        {"image_id": 7, "width": 90, "height": 300, "objects": objects[:1]}]}))
    g = ObjectBoxes.load(path)
    for size in (None, 32, 224):
        assert g.crop_boxes(["a", 7], size) == _old_crop_boxes(path, ["a", 7], size)
    left, top, w, h = g.crop_boxes(["a"], None)[0][0]["bbox"]
    assert (left, top, w, h) == pytest.approx((0.0, 0.1, 0.2, 0.3))
    assert g.crop_boxes(["a"], 32)[0][1]["bbox"][2] == 0  # outside the centre crop
    assert g.crop_boxes([], 32) == []


def test_boxes_path_grounds_any_source(tmp_path: Path, shapes_root: Path) -> None:
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"images": [
        {"image_id": 0, "width": 64, "height": 64,
         "objects": [{"color": "red", "shape": "circle", "bbox": [1, 2, 3, 4]}]}]}))
    split_file = str(shapes_root / "dataset_shapes.json")
    dm = CaptionDataModule(source=KarpathySplits(split_file=split_file, boxes_path=str(path)))
    assert dm.grounding is not None and list(dm.grounding.ids) == [0]
    assert dm.boxes == {0: [{"color": "red", "shape": "circle", "bbox": [1, 2, 3, 4]}]}
    assert dm.grounding.objects(0) == {("red", "circle")}
    shapes = CaptionDataModule(source=ShapesSource(root=str(shapes_root), boxes_path=str(path),
                                                   **SHAPES_PARAMS))
    assert shapes.boxes == dm.boxes
    assert CaptionDataModule(source=KarpathySplits(split_file=split_file)).grounding is None


def test_grounding_reads_the_boxes_file_once(dm: CaptionDataModule,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    reads: list[int] = []

    load_json = sources.load_json

    def counting(path: Any) -> Any:
        reads.append(1)
        return load_json(path)

    monkeypatch.setattr(sources, "load_json", counting)
    g = dm.grounding
    assert g is not None and dm.grounding is g and dm.boxes is g.table
    g.crop_boxes(list(g.ids), dm.image_size)
    assert len(reads) == 1


@pytest.mark.parametrize(("entry", "field", "words"), [
    ({"objects": [], "image_id": 1, "height": 9}, "width", "missing"),
    ({"objects": [], "image_id": 1, "width": 9}, "height", "missing"),
    ({"objects": [{"shape": "circle", "bbox": [0, 0, 1, 1]}], "image_id": 1, "width": 9,
      "height": 9}, "objects[0].color", "missing"),
    ({"objects": [{"color": "red", "shape": "circle", "bbox": [0, 1]}], "image_id": 1,
      "width": 9, "height": 9}, "objects[0].bbox", "expected [x, y, w, h]"),
    ({"image_id": 1, "width": 9, "height": 9}, "objects", "missing"),
])
def test_a_bad_boxes_file_is_named(tmp_path: Path, entry: dict, field: str, words: str) -> None:
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"images": [entry]}))
    with pytest.raises(DataError) as info:
        ObjectBoxes.load(path)
    assert str(info.value).startswith(f"{path}: images[0]: field '{field}': {words}")
    with pytest.raises(DataError, match=r"missing\.json: \(file\): field '\(file\)': file does"):
        ObjectBoxes.load(tmp_path / "missing.json")


def test_empty_and_repeated_box_ids_are_named(tmp_path: Path) -> None:
    """An id the readers would refuse, or an image listed twice (its first objects would be
    lost), is a problem of the file's entry, not a table that silently holds less."""
    good = {"objects": [], "width": 9, "height": 9}
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"images": [{**good, "image_id": 1}, {**good, "image_id": ""},
                                           {**good, "image_id": 1}]}))
    with pytest.raises(DataError) as info:
        ObjectBoxes.load(path)
    assert [(p.entry, p.field, p.message) for p in info.value.problems] == [
        ("images[1]", "image_id", "expected an int or non-empty string, got str"),
        ("images[2]", "image_id", "duplicate image id 1 (first in images[0])")]
    assert {p.file for p in info.value.problems} == {str(path)}


def test_a_bad_boxes_path_fails_at_setup(tmp_path: Path, shapes_root: Path) -> None:
    path = tmp_path / "boxes.json"
    path.write_text(json.dumps({"images": [{"image_id": 0, "objects": []}]}))
    dm = CaptionDataModule(source=ShapesSource(root=str(shapes_root), boxes_path=str(path),
                                               **SHAPES_PARAMS))
    with pytest.raises(DataError, match=r"boxes\.json: images\[0\]: field 'width': missing"):
        dm.setup("fit")
    missing = CaptionDataModule(source=ShapesSource(
        root=str(shapes_root), boxes_path=str(tmp_path / "nope.json"), **SHAPES_PARAMS))
    with pytest.raises(DataError, match=r"nope\.json: .*file does not exist"):
        missing.setup("fit")


def test_shapes_grounding_generates_the_dataset(tmp_path: Path) -> None:
    source = ShapesSource(root=str(tmp_path / "s"), num_train=2, num_val=1, num_test=1,
                          image_size=32)
    dm = CaptionDataModule(source=source)
    assert dm.grounding is not None and len(dm.grounding) == 4
    assert len(dm.records("train")) == 2


# ------------------------------------------------------------------------------------------
# Plain-data form: equality, config, hyperparameters, LightningCLI


def test_sources_compare_by_arguments_and_round_trip_as_config() -> None:
    a = KarpathySplits(split_file="d/x.json", merge_restval=False)
    assert a == KarpathySplits(split_file="d/x.json", merge_restval=False)
    assert a != KarpathySplits(split_file="d/x.json")
    assert hash(a) == hash(KarpathySplits(split_file="d/x.json", merge_restval=False))
    assert ShapesSource() != KarpathySplits(split_file="data/shapes/dataset_shapes.json")
    for source in (a, ShapesSource(num_val=3, boxes_path="b.json"),
                   CocoCaptions(train_annotations="t.json", train_images="t", carve_size=9)):
        config = source.config()
        assert config["class_path"].startswith("captioning.data.sources.")
        assert DataSource.from_config(json.loads(json.dumps(config))) == source
        assert repr(source).startswith(type(source).__name__ + "(")
    assert ShapesSource(root="r").config()["init_args"]["root"] == "r"
    with pytest.raises(ValueError, match="not a DataSource"):
        DataSource.from_config({"class_path": "pathlib.Path"})


def test_hyperparameters_hold_the_source_as_plain_data(dm: CaptionDataModule,
                                                       tmp_path: Path) -> None:
    assert dm.hparams["source"] == dm.source.config()
    assert dm.hparams["batch_size"] == 4 and "root" not in dm.hparams
    assert dict(dm.hparams_initial) == dict(dm.hparams)
    torch.save({"datamodule_hyper_parameters": dict(dm.hparams)}, tmp_path / "h.pt")
    loaded = torch.load(tmp_path / "h.pt", weights_only=True)
    assert DataSource.from_config(loaded["datamodule_hyper_parameters"]["source"]) == dm.source


def _parser() -> Any:
    from lightning.pytorch.cli import LightningArgumentParser

    parser = LightningArgumentParser(exit_on_error=False)
    parser.add_argument("--config", action="config")
    parser.add_lightning_class_args(CaptionDataModule, "data")
    return parser


def test_yaml_class_path_round_trip(tmp_path: Path, shapes_root: Path) -> None:
    source = ShapesSource(root=str(shapes_root), **SHAPES_PARAMS)
    cfg_file = tmp_path / "data.yaml"
    cfg_file.write_text(yaml.safe_dump({"data": {"source": source.config(), "image_size": 64}}))
    parser = _parser()
    cfg = parser.parse_args(["--config", str(cfg_file)])
    dm = parser.instantiate(cfg).data
    assert isinstance(dm, CaptionDataModule) and dm.source == source and dm.image_size == 64
    dumped = yaml.safe_load(parser.dump(cfg))
    assert dumped["data"]["source"]["class_path"] == "captioning.data.sources.ShapesSource"
    assert DataSource.from_config(dumped["data"]["source"]) == source
    # a config file's source, then one argument of it overridden on the command line
    cfg = parser.parse_args(["--config", str(cfg_file), "--data.source.num_val", "3"])
    assert parser.instantiate(cfg).data.source == ShapesSource(
        root=str(shapes_root), **{**SHAPES_PARAMS, "num_val": 3})


def test_cli_flags_give_the_fixture_data(shapes_root: Path,
                                         shapes_dm_kwargs: dict[str, Any]) -> None:
    parser = _parser()
    dm = parser.instantiate(parser.parse_args(shapes_cli_args(shapes_root))).data
    expected = CaptionDataModule(**shapes_dm_kwargs)
    assert dm.source == expected.source
    assert (dm.image_size, dm.batch_size, dm.eval_batch_size) == (64, 4, 8)
    cfg = parser.parse_args(["--data.source", "KarpathySplits", "--data.source.split_file",
                             "x.json", "--data.source.merge_restval", "false"])
    assert parser.instantiate(cfg).data.source == KarpathySplits(split_file="x.json",
                                                                 merge_restval=False)
    assert parser.instantiate(parser.parse_args([])).data.source == ShapesSource()


def test_a_missing_annotation_file_names_the_setting_to_change(tmp_path: Path) -> None:
    """A source's file that does not exist says which `data.source` setting names it: the
    file itself (`split_file`) or the folder that holds it (`root` of a caption table, where a
    config's placeholder was left as it is)."""
    from captioning.data.tables import JsonlCaptions

    missing = tmp_path / "nowhere" / "dataset_coco.json"
    cases = [(KarpathySplits(split_file=str(missing)), "split_file", missing),
             (JsonlCaptions(root="data/my_images"), "root", Path("data/my_images/captions.jsonl"))]
    for source, key, file in cases:
        with pytest.raises(DataError) as e:
            _ = CaptionDataModule(source=source, feature_cache=False).vocab
        [problem] = e.value.problems
        assert (problem.file, problem.field) == (str(file), "(file)")
        assert problem.message.startswith("file does not exist (data.source.")
        assert f"pass --data.source.{key} with the right path" in problem.message
