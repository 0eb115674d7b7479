"""Bad input data (captioning/data/datamodule.py, images.py): every image is checked when the
data is set up (all bad files of all splits listed at once, before any step), odd-but-valid
images train without a crash, skips are counted and logged to the loggers."""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from conftest import shapes_source
from lightning.pytorch.loggers import CSVLogger
from PIL import Image, ImageFile
from tiny_runs import (
    cli_config,
    error_lines,
    make_dm,
    make_module,
    make_trainer,
)

from captioning.cli import main
from captioning.data.datamodule import CaptionDataModule
from captioning.data.images import check_image
from captioning.data.problems import DataError
from captioning.data.sources import KarpathySplits

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


# ------------------------------------------------------------------------------------------
# Data: validated at setup, skipped items counted and logged


def _exif_rotated() -> tuple[Image.Image, bytes]:
    exif = Image.Exif()
    exif[0x0112] = 6
    return Image.new("RGB", (40, 20), (0, 0, 255)), exif.tobytes()


def _odd_images(images: Path) -> None:
    """Overwrite some images with valid but unusual ones (modes, sizes, EXIF, formats)."""
    odd: dict[str, Callable[[Path], None]] = {
        "train_00005.png": lambda p: Image.new("L", (64, 64), 90).save(p),
        "train_00006.png": lambda p: Image.new("LA", (64, 64), (90, 0)).save(p),
        "train_00007.png": lambda p: Image.new("P", (64, 64), 3).save(p, transparency=3),
        "train_00008.png": lambda p: Image.new("RGBA", (64, 64), (9, 9, 9, 128)).save(p),
        "train_00009.png": lambda p: Image.new("CMYK", (64, 48), (0, 255, 255, 0))
        .save(p, format="JPEG"),  # JPEG content behind a .png name
        "train_00010.png": lambda p: Image.new("I;16", (64, 64), 40000).save(p),
        "train_00011.png": lambda p: Image.new("RGB", (1, 1), (5, 200, 5)).save(p),
        "train_00012.png": lambda p: _exif_rotated()[0].save(p, format="JPEG",
                                                             exif=_exif_rotated()[1]),
        "train_00013.png": lambda p: Image.new("RGB", (3000, 2000), (200, 9, 9)).save(p),
    }
    for name, write in odd.items():
        write(images / name)


BAD_IMAGES = ["train_00001.png", "train_00002.png", "train_00003.png", "train_00004.png",
              "val_00001.png"]


def _bad_images(images: Path) -> None:
    """Break some train and val images in every way (`BAD_IMAGES`)."""
    (images / "train_00001.png").write_bytes(b"")
    data = (images / "train_00002.png").read_bytes()
    (images / "train_00002.png").write_bytes(data[: len(data) // 2])
    (images / "train_00003.png").write_text("not an image at all")
    (images / "train_00004.png").unlink()
    corrupt = bytearray((images / "val_00001.png").read_bytes())
    corrupt[60] ^= 0xFF  # inside the first IDAT chunk: its CRC no longer matches
    (images / "val_00001.png").write_bytes(bytes(corrupt))


@pytest.fixture(scope="module")
def messy_root(shapes_root: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shapes dataset with broken and with unusual-but-valid images."""
    root = tmp_path_factory.mktemp("messy") / "shapes"
    shutil.copytree(shapes_root, root)
    _odd_images(root / "images")
    _bad_images(root / "images")
    return root


@pytest.fixture
def messy_kwargs(messy_root: Path, shapes_dm_kwargs: dict) -> dict[str, Any]:
    """Data module arguments for it, read as a Karpathy file (the shapes reader would
    regenerate a dataset with missing files)."""
    return {**shapes_dm_kwargs, "min_word_count": 1,
            "source": KarpathySplits(split_file=str(messy_root / "dataset_shapes.json"))}


class _CountSteps(L.Callback):
    def __init__(self) -> None:
        self.steps = 0

    def on_train_batch_start(self, *args: Any) -> None:
        self.steps += 1


def test_bad_images_of_every_split_fail_setup_before_any_step(
        messy_root: Path, messy_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    dm = make_dm(messy_kwargs, cache_dir)
    counter = _CountSteps()
    with pytest.raises(DataError) as info:
        make_trainer(tmp_path / "ckpt", counter).fit(make_module(dm), datamodule=dm)
    assert counter.steps == 0
    problems = {Path(p.file).name: p for p in info.value.problems}
    assert sorted(problems) == BAD_IMAGES
    assert "empty (0 bytes)" in problems["train_00001.png"].message
    assert "truncated" in problems["train_00002.png"].message
    assert "not an image" in problems["train_00003.png"].message
    assert "does not exist" in problems["train_00004.png"].message
    assert problems["val_00001.png"].entry.startswith("val image")
    msg = str(info.value)
    assert msg.startswith("5 problems in the data:")
    assert f"{messy_root / 'images' / 'train_00003.png'}: train image" in msg
    assert "field 'image'" in msg
    # The same through the CLI: the listing after one `error:` line, status 1.
    cfg = cli_config(tmp_path / "c.yaml", messy_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["fit", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    (line,) = error_lines(err)
    assert line == "error: 5 problems in the data:"
    assert "train_00004.png: train image" in err and "Traceback" not in err


def test_skip_policy_trains_on_the_rest_and_logs_the_counts(messy_kwargs: dict,
                                                          tmp_path: Path) -> None:
    # No feature cache: every remaining image (odd modes, 1x1, 3000x2000, EXIF, CMYK JPEG,
    # 16-bit) is decoded by the training and validation loaders, mid-epoch.
    dm = CaptionDataModule(**{**messy_kwargs, "batch_size": 16, "on_bad_data": "skip",
                              "feature_cache": False})
    module = make_module(dm)
    logger = CSVLogger(str(tmp_path), name="csv")
    trainer = L.Trainer(max_epochs=1, limit_val_batches=None, num_sanity_val_steps=0,
                        logger=logger, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, accelerator="cpu", devices=1,
                        default_root_dir=str(tmp_path))
    trainer.fit(module, datamodule=dm)
    assert dm.skipped == {"captions": 0, "images": 0, "image_files": 5}
    assert len(dm.records("train")) == 20 and len(dm.records("val")) == 7
    assert trainer.global_step == math.ceil(20 * 5 / 16)
    assert all(torch.isfinite(p).all() for p in module.parameters())
    rows = (Path(logger.log_dir) / "metrics.csv").read_text().splitlines()
    header = rows[0].split(",")
    first = dict(zip(header, rows[1].split(",")))
    assert float(first["data/skipped_image_files"]) == 5.0
    assert float(first["data/skipped_captions"]) == 0.0


def test_split_left_empty_by_skipping_names_the_file(shapes_root: Path,
                                                     shapes_dm_kwargs: dict,
                                                     tmp_path: Path) -> None:
    root = tmp_path / "shapes"
    shutil.copytree(shapes_root, root)
    for p in (root / "images").glob("val_*.png"):
        p.write_bytes(b"")
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "source": shapes_source(root),
                              "on_bad_data": "skip", "feature_cache": False})
    with pytest.raises(DataError, match=r"dataset_shapes\.json: val split: field 'split': the "
                                        r"val split has no usable images"):
        dm.setup("fit")
    assert dm.skipped["image_files"] == 8


def test_header_check_decodes_no_pixels(tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    png, jpg = tmp_path / "a.png", tmp_path / "a.jpg"
    Image.new("RGB", (300, 200), (1, 2, 3)).save(png)
    _exif_rotated()[0].save(jpg, exif=_exif_rotated()[1])

    def no_decoding(self: Any) -> None:
        raise AssertionError("pixel data decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    assert check_image(png) == (300, 200)
    assert check_image(jpg) == (20, 40)  # orientation 6: width and height swap


def test_a_wrong_image_folder_is_named_first(tmp_path: Path,
                                             write_karpathy: Callable[..., Path]) -> None:
    """Where none of a split's images exists, the first problem is the setting that names the
    folder they were looked for in (a wrong image_root), before the missing files."""
    split_file = write_karpathy(tmp_path / "dataset_flickr8k.json", [
        {"id": i, "filename": f"{i}.jpg", "split": "train", "captions": ["a dog runs"]}
        for i in range(3)], layout="flickr")
    wrong = tmp_path / "Flicker8k_Dataset"
    dm = CaptionDataModule(source=KarpathySplits(split_file=str(split_file),
                                                 image_root=str(wrong)), min_word_count=1)
    with pytest.raises(DataError) as e:
        dm.setup("fit")
    first, *missing = e.value.problems
    assert (first.file, first.entry, first.field) == (str(wrong), "(folder)",
                                                      "data.source.image_root")
    assert first.message == ("none of the 3 train images exists under it: pass "
                             "--data.source.image_root with the folder that holds them")
    assert [p.field for p in missing] == ["image"] * 3


def test_an_image_listed_twice_in_a_split_is_warned_of(
        tmp_path: Path, write_karpathy: Callable[..., Path],
        caplog: pytest.LogCaptureFixture) -> None:
    """The same file under two ids in one split counts twice (in two splits it is an error,
    `split_overlaps`): one warning a split names the file and both ids."""
    from captioning.data.reading import read_source

    specs = [{"id": i, "filename": f"{i % 3}.jpg", "split": "train", "captions": ["a dog"]}
             for i in range(5)]  # 3.jpg and 4.jpg: the files of ids 0 and 1 again
    split_file = write_karpathy(tmp_path / "dataset_flickr8k.json", specs, layout="flickr")
    source = KarpathySplits(split_file=str(split_file), image_root=str(tmp_path))
    with caplog.at_level("WARNING"):
        read = read_source(source, "fail", validate_images=False)
    assert len(read.splits["train"]) == 5
    assert [r.getMessage() for r in caplog.records] == [
        f"2 image files are listed twice in the train split under other ids (first: "
        f"{tmp_path / '0.jpg'}, as 0 and 3); each listing counts as an image"]


@pytest.mark.parametrize("damage", ["missing", "not an image"])
def test_unchecked_images_fail_the_cache_build_naming_the_entry(
        damage: str, messy_kwargs: dict, messy_root: Path, tmp_path: Path) -> None:
    """With `validate_images` false, the first bad image the feature cache meets stops the
    build in one problem naming the file, its split and id, and the setting that lists them
    all before any step (a missing one was a bare `[Errno 2]` from the cache's key)."""
    from captioning.data.serving import attach_feature_cache

    name = "train_00004.png" if damage == "missing" else "train_00003.png"
    kwargs = {k: v for k, v in messy_kwargs.items() if k != "source"}
    data = json.loads((messy_root / "dataset_shapes.json").read_text())
    # only the damaged image among good ones: the one that the cache build meets first
    data["images"] = [i for i in data["images"]
                      if i["filename"] == name or (i["split"] != "train" and
                                                   i["filename"] not in BAD_IMAGES)
                      or i["filename"] in ("train_00000.png", "train_00014.png")]
    split_file = tmp_path / "dataset_shapes.json"
    split_file.write_text(json.dumps(data))
    source = KarpathySplits(split_file=str(split_file), image_root=str(messy_root))
    dm = make_dm({**kwargs, "source": source, "validate_images": False}, tmp_path / "cache")
    module = make_module(dm)
    attach_feature_cache(dm, module.captioner.encoder, module.captioner.feature_cache_key(),
                         device="cpu")
    with pytest.raises(DataError) as e:
        dm.cache_features(["train"])
    (problem,) = e.value.problems
    entry = next(i for i in data["images"] if i["filename"] == name)
    image_id = entry.get("cocoid", entry["imgid"])
    assert (problem.file, problem.entry, problem.field) == (
        str(messy_root / "images" / name), f"train image {image_id!r}", "image")
    assert problem.message.startswith(
        "file does not exist; " if damage == "missing" else "not an image (Pillow")
    assert problem.message.endswith("data.validate_images is false: set it true to list every "
                                    "bad image before any step (with data.on_bad_data: skip, "
                                    "to leave them out)")
    # checked up front (a header check) and still bad when decoded: no hint to set it true
    from captioning.data.images import ImageLoadError
    from captioning.data.reading import unchecked_image

    record = next(r for r in dm.records("train") if Path(r.path).name == name)
    (checked,) = unchecked_image([record], "train", ImageLoadError(record.path, "truncated"),
                                 validated=True)
    assert (checked.file, checked.message) == (str(record.path), "truncated")
    assert not list((tmp_path / "cache").rglob("*.npy"))  # nothing half-built left behind


def test_every_problem_of_the_data_is_listed_in_the_run_folder(
        messy_root: Path, messy_kwargs: dict, shapes_dm_kwargs: dict, cache_dir: Path,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The error lists ten problems; the run folder's data_problems.txt lists them all, as do
    the problems `on_bad_data: skip` left out, a section a stage. A later run of the stage
    that reads clean data removes its section; one refused before it reads any leaves it."""
    root = tmp_path / "data"
    shutil.copytree(messy_root, root)
    for i in range(15, 21):  # six more missing: 11 problems
        (root / "images" / f"train_{i:05d}.png").unlink()
    kwargs = {**messy_kwargs,
              "source": KarpathySplits(split_file=str(root / "dataset_shapes.json"))}
    run = tmp_path / "run"
    cfg = cli_config(tmp_path / "c.yaml", kwargs, cache_dir, run / "ckpt")
    listed = run / "data_problems.txt"
    assert main(["fit", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert error_lines(err) == ["error: 11 problems in the data:"]
    assert f"  ... and 1 more (all 11 in {listed})" in err.splitlines()
    head, *lines = listed.read_text().splitlines()
    assert head == "# 11 problems in the data (fit: stopped)"
    assert [ln.strip() for ln in err.splitlines() if ln.startswith("  /")] == lines[:10]
    assert {Path(ln.split(":")[0]).name for ln in lines} == {
        *BAD_IMAGES, *(f"train_{i:05d}.png" for i in range(15, 21))}

    assert main(["fit", "--config", str(cfg), "--data.on_bad_data", "skip"]) == 0
    head, *skipped = listed.read_text().splitlines()
    assert head == "# 11 problems in the data (fit: skipped by data.on_bad_data)"
    assert sorted(skipped) == sorted(lines)
    kept = listed.read_text()  # a command refused before it reads any data leaves the list
    assert main(["fit", "--config", str(cfg), "--model.net.score", "cosine"]) == 2
    assert listed.read_text() == kept
    # a test of clean images checks no training image: fit's list stays, beside the test's own
    assert main(["test", "--config", str(cfg), "--data.on_bad_data", "skip",
                 "--ckpt_path", str(run / "ckpt" / "last.ckpt")]) == 0
    assert listed.read_text().startswith(kept)
    assert all(not ln.startswith("# ") or "(test: " in ln
               for ln in listed.read_text()[len(kept):].splitlines())

    dm = CaptionDataModule(**kwargs, on_bad_data="skip")  # the file may change: after checks
    dm.records("train")
    assert not dm.checked  # read, not checked: a command refused now leaves the file
    dm.setup("fit")
    assert dm.checked and len(dm.problems) == 11
    clean = cli_config(tmp_path / "clean.yaml", shapes_dm_kwargs, cache_dir, run / "ckpt")
    assert main(["fit", "--config", str(clean)]) == 0
    assert "(fit: " not in listed.read_text() if listed.exists() else True
    assert main(["test", "--config", str(clean), "--ckpt_path", "last"]) == 0
    assert not listed.exists()  # every section's data read clean since: no list holds


def test_a_stop_lists_what_was_skipped_before_it(messy_root: Path, messy_kwargs: dict,
                                                 cache_dir: Path, tmp_path: Path) -> None:
    """With `on_bad_data: skip`, a training split left empty stops the run (before the data
    module is the CLI's: the vocabulary is built as the model is); the run folder's list holds
    every caption skipped, then the line that stopped it."""
    data = json.loads((messy_root / "dataset_shapes.json").read_text())
    train = [i for i in data["images"] if i["split"] == "train"]
    for entry in train:
        for sentence in entry["sentences"]:
            sentence.update(raw="  ", tokens=[])
    split_file = tmp_path / "dataset_shapes.json"
    split_file.write_text(json.dumps(data))
    kwargs = {**messy_kwargs, "on_bad_data": "skip", "source": KarpathySplits(
        split_file=str(split_file), image_root=str(messy_root))}
    run = tmp_path / "run"
    assert main(["fit", "--config", str(cli_config(tmp_path / "c.yaml", kwargs, cache_dir,
                                                   run / "ckpt"))]) == 1
    head, *lines = (run / "data_problems.txt").read_text().splitlines()
    assert head == f"# {len(lines)} problems in the data (fit: stopped)"
    assert lines[-1].endswith("train split: field 'split': is empty: no vocabulary can be "
                              "built from it")
    assert sum("caption is empty" in ln for ln in lines) >= sum(
        len(i["sentences"]) for i in train)


def test_a_stages_problems_are_its_section_of_the_list(tmp_path: Path) -> None:
    """`save_problems` replaces its stage's section only; none removes it; the file goes with
    its last one; an unreadable file is replaced."""
    from captioning.data.problems import PROBLEMS_FILE, Problem, save_problems

    a, b = Problem("x.json", "images[1]", "file", "gone"), Problem("y.png", "(file)", "image", "bad")
    file = tmp_path / PROBLEMS_FILE
    assert save_problems(tmp_path, "test", [b], "skipped") == file
    assert save_problems(tmp_path, "fit", [a, b], "stopped") == file
    assert file.read_text().splitlines() == [
        "# 2 problems in the data (fit: stopped)", str(a), str(b),
        "# 1 problems in the data (test: skipped)", str(b)]
    save_problems(tmp_path, "fit", [b], "skipped")
    assert file.read_text().splitlines() == [
        "# 1 problems in the data (fit: skipped)", str(b),
        "# 1 problems in the data (test: skipped)", str(b)]
    assert save_problems(tmp_path, "test", [], "skipped") == file
    assert "test" not in file.read_text()
    assert save_problems(tmp_path, "fit", [], "skipped") is None and not file.exists()
    file.write_bytes(b"\xff\xfe garbage")
    save_problems(tmp_path, "validate", [a], "skipped")
    assert file.read_text().splitlines() == ["# 1 problems in the data (validate: skipped)", str(a)]
