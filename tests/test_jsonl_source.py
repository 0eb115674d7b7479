"""Your own images (captioning/data/tables.py): the captions.jsonl / .csv reader and its problems,
the JsonlCaptions source (carving by image, arguments), its config, a tiny `captioning fit` and
`test` on a folder of PNGs, and the README's example."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image, ImageDraw
from tiny_runs import BATCHES, REPO, cli_config, print_config

import captioning
from captioning import metrics
from captioning.cli import main
from captioning.data import JsonlCaptions as ExportedJsonlCaptions
from captioning.data.datamodule import CaptionDataModule
from captioning.data.problems import DataError, Problem
from captioning.data.sources import DataSource
from captioning.data.tables import JsonlCaptions, read_captions_table

JSONL_CONFIG = Path(captioning.__file__).parent / "configs" / "data" / "jsonl.yaml"
README = REPO / "README.md"


def _write_jsonl(path: Path, lines: list[Any]) -> Path:
    """One line per item: a dict as JSON, a string as it is (bad JSON, blank lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join((x if isinstance(x, str) else json.dumps(x)) + "\n" for x in lines),
                    encoding="utf-8")
    return path


def _line(image: str, caption: str = "a red circle", split: str | None = None) -> dict:
    return {"image": image, "caption": caption} | ({"split": split} if split else {})


def _only_problem(file: Path, **kwargs: Any) -> Problem:
    with pytest.raises(DataError) as err:
        read_captions_table(file, file.parent, **kwargs)
    assert len(err.value.problems) == 1, err.value.problems
    return err.value.problems[0]


# ------------------------------------------------------------------------------------------
# Reading


def test_reads_jsonl_by_image(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "captions.jsonl", [
        _line("dogs/1.jpg", " A dog runs. ", "train"), _line("cats/7.png", "a cat", "val"),
        "", _line("dogs/./1.jpg", "a brown dog", "train"), _line("x.png", "a fish", "test")])
    recs = read_captions_table(f, tmp_path / "imgs")
    assert [(r.image_id, r.split, r.captions) for r in recs] == [
        ("dogs/1.jpg", "train", ("A dog runs.", "a brown dog")),
        ("cats/7.png", "val", ("a cat",)), ("x.png", "test", ("a fish",))]
    assert recs[0].path == tmp_path / "imgs" / "dogs" / "1.jpg"
    assert recs.problems == () and recs.skipped_captions == recs.skipped_images == 0


def test_without_a_split_every_image_is_train(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "captions.jsonl", [_line("a.png"), _line("b.png")])
    assert {r.split for r in read_captions_table(f, tmp_path)} == {"train"}


BAD_LINES = [
    ("{not json", "(json)", "malformed JSON"),
    ("[1, 2]", "(entry)", "expected a JSON object, got list"),
    ({"caption": "a dog"}, "image", "missing"),
    ({"image": 3, "caption": "a dog"}, "image", "expected a string, got int"),
    ({"image": "", "caption": "a dog"}, "image", "expected a relative image path"),
    ({"image": "/data/a.png", "caption": "a dog"}, "image", "absolute path"),
    ({"image": "../a.png", "caption": "a dog"}, "image", "escapes the image folder"),
    ({"image": "a/../../b.png", "caption": "a dog"}, "image", "escapes the image folder"),
    ({"image": "a.png"}, "caption", "missing"),
    ({"image": "a.png", "caption": None}, "caption", "expected a string, got null"),
    ({"image": "a.png", "caption": ""}, "caption", "caption is empty or whitespace"),
    ({"image": "a.png", "caption": " \t"}, "caption", "caption is empty or whitespace"),
    ({"image": "a.png", "caption": "?!"}, "caption", "no word tokens"),
    ({"image": "a.png", "caption": "a dog", "split": "dev"}, "split", "unknown split 'dev'"),
    ({"image": "a.png", "caption": "a dog", "split": None}, "split", "unknown split None"),
]


@pytest.mark.parametrize(("bad", "field", "words"), BAD_LINES,
                         ids=lambda x: x if isinstance(x, str) else None)
def test_a_bad_line_names_file_line_and_field(tmp_path: Path, bad: Any, field: str,
                                              words: str) -> None:
    split = "train" if isinstance(bad, dict) and "split" in bad else None
    good = [_line("b.png", "a dog", split), _line("c.png", "a cat", split)]
    f = _write_jsonl(tmp_path / "captions.jsonl", [good[0], "", bad, good[1]])
    problem = _only_problem(f)
    assert (problem.file, problem.entry, problem.field) == (str(f), "line 3", field)
    assert words in problem.message
    assert str(problem).startswith(f"{f}: line 3: field '{field}': ")
    kept = read_captions_table(f, tmp_path, on_error="skip")
    assert [r.image_id for r in kept] == ["b.png", "c.png"]
    assert kept.skipped_captions == 1 and kept.problems == (problem,)


def test_fail_lists_every_problem(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "captions.jsonl", [
        _line("a.png"), {"image": "/a.png", "caption": ""}, "oops", _line("../b.png")])
    with pytest.raises(DataError, match="4 problems in the data") as err:
        read_captions_table(f, tmp_path)
    assert [(p.entry, p.field) for p in err.value.problems] == [
        ("line 2", "image"), ("line 2", "caption"), ("line 3", "(json)"), ("line 4", "image")]


def test_split_on_every_line_or_none(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "captions.jsonl", [
        _line("a.png", split="train"), _line("b.png"), _line("c.png", split="val"),
        _line("d.png", split="test")])
    problem = _only_problem(f)
    assert (problem.entry, problem.field) == ("line 2", "split")
    assert "missing, but 3 other lines give a split" in problem.message
    kept = read_captions_table(f, tmp_path, on_error="skip")
    assert [(r.image_id, r.split) for r in kept] == [("a.png", "train"), ("c.png", "val"),
                                                     ("d.png", "test")]
    few = _write_jsonl(tmp_path / "few.jsonl", [_line("a.png"), _line("b.png", split="val"),
                                                _line("c.png")])
    problem = _only_problem(few)
    assert problem.entry == "line 2" and "given, but 2 other lines give none" in problem.message


def test_the_lines_of_an_image_agree_on_its_split(tmp_path: Path) -> None:
    f = _write_jsonl(tmp_path / "captions.jsonl", [
        _line("a.png", split="train"), _line("b.png", split="train"),
        _line("a.png", "a blue square", split="val")])
    problem = _only_problem(f)
    assert (problem.file, problem.entry, problem.field) == (str(f), "line 3", "split")
    assert "image 'a.png' is in 'val' here but in 'train' on line 1" in problem.message
    kept = read_captions_table(f, tmp_path, on_error="skip")
    assert [r.image_id for r in kept] == ["b.png"] and kept.skipped_images == 1


def test_reads_csv_like_jsonl(tmp_path: Path) -> None:
    f = tmp_path / "captions.csv"
    f.write_text('image,caption,split\ndogs/1.jpg,"A dog, running.",train\n\n'
                 'cats/7.png,a cat,val\ndogs/1.jpg,a brown dog,train\n', encoding="utf-8-sig")
    recs = read_captions_table(f, tmp_path)
    assert [(r.image_id, r.split, r.captions) for r in recs] == [
        ("dogs/1.jpg", "train", ("A dog, running.", "a brown dog")),
        ("cats/7.png", "val", ("a cat",))]
    no_split = tmp_path / "plain.csv"
    no_split.write_text("caption,image\na dog,a.png\na cat,b.png\n")
    assert [(r.image_id, r.split) for r in read_captions_table(no_split, tmp_path)] == [
        ("a.png", "train"), ("b.png", "train")]


@pytest.mark.parametrize(("row", "field", "words"), [
    ("/abs.png,a dog,train", "image", "absolute path"),
    ("../a.png,a dog,train", "image", "escapes the image folder"),
    (",a dog,train", "image", "expected a relative image path"),
    ("a.png,,train", "caption", "caption is empty or whitespace"),
    ("a.png", "caption", "missing"),
    ("a.png,a dog,dev", "split", "unknown split 'dev'"),
    ("a.png,a dog,", "split", "missing, but 2 other lines give a split"),
    ("a.png,a dog,train,extra", "(entry)", "4 cells, the header has 3"),
])
def test_a_bad_csv_row_names_its_line(tmp_path: Path, row: str, field: str, words: str) -> None:
    f = tmp_path / "captions.csv"
    f.write_text(f"image,caption,split\nb.png,a dog,train\n\n{row}\nc.png,a cat,val\n")
    problem = _only_problem(f)
    assert (problem.file, problem.entry, problem.field) == (str(f), "line 4", field)
    assert words in problem.message


def test_a_csv_header_needs_image_and_caption(tmp_path: Path) -> None:
    f = tmp_path / "captions.csv"
    f.write_text("file,text\na.png,a dog\n")
    problem = _only_problem(f, on_error="skip")  # always raises
    assert (problem.entry, problem.field) == ("line 1", "(header)")
    assert "expected the columns image,caption[,split], got file,text" in problem.message


def test_unreadable_tables_always_raise(tmp_path: Path) -> None:
    cases = {"missing.jsonl": "file does not exist", "empty.jsonl": "no caption lines",
             "blank.csv": "no caption lines", "latin1.jsonl": "not UTF-8",
             "folder.jsonl": "is a directory", "loop.jsonl": "cannot read file"}
    (tmp_path / "loop.jsonl").symlink_to(tmp_path / "loop.jsonl")  # any other OS error
    (tmp_path / "empty.jsonl").write_text("\n  \n")
    (tmp_path / "blank.csv").write_text("image,caption\n")
    (tmp_path / "latin1.jsonl").write_bytes(b'{"image": "a.png", "caption": "caf\xe9"}\n')
    (tmp_path / "folder.jsonl").mkdir()
    for name, words in cases.items():
        assert words in _only_problem(tmp_path / name, on_error="skip").message, name
    with pytest.raises(ValueError, match=r"a caption table is a \.jsonl or \.csv file"):
        read_captions_table(tmp_path / "captions.txt", tmp_path)
    with pytest.raises(ValueError, match="on_error"):
        read_captions_table(tmp_path / "empty.jsonl", tmp_path, on_error="ignore")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------
# The source: carving, arguments


def _unsplit(tmp_path: Path, n: int = 20, name: str = "captions.jsonl",
             shuffle: bool = False) -> Path:
    lines = [_line(f"img_{i:02d}.png", f"a picture number {i} {k}") for i in range(n)
             for k in range(2)]
    if shuffle:
        random.Random(1).shuffle(lines)
    return _write_jsonl(tmp_path / name, lines)


def _ids(source: JsonlCaptions) -> dict[str, list[Any]]:
    return {s: sorted(r.image_id for r in rs) for s, rs in source.read().splits.items()}


def test_carves_whole_images_the_same_every_time(tmp_path: Path) -> None:
    _unsplit(tmp_path)
    source = JsonlCaptions(root=str(tmp_path))
    got = source.read()
    assert [len(got.splits[s]) for s in ("train", "val", "test")] == [16, 2, 2]  # a tenth each
    assert all(len(r.captions) == 2 and r.split == s for s, rs in got.splits.items() for r in rs)
    ids = _ids(source)
    assert not set(ids["val"]) & set(ids["test"]) and not set(ids["train"]) & set(ids["val"])
    _unsplit(tmp_path, name="shuffled.jsonl", shuffle=True)
    assert _ids(JsonlCaptions(root=str(tmp_path), captions="shuffled.jsonl")) == ids
    a = CaptionDataModule(source=source, image_size=32)
    b = CaptionDataModule(source=source, image_size=32, seed=5)
    assert [r.image_id for r in a.records("val")] == [r.image_id for r in b.records("val")]
    counts = _ids(JsonlCaptions(root=str(tmp_path), val_size=3, test_size=5))
    assert [len(counts[s]) for s in ("train", "val", "test")] == [12, 3, 5]


def test_carves_only_the_splits_the_table_lacks(tmp_path: Path) -> None:
    lines = [_line(f"{i}.png", "a dog", "val" if i < 3 else "train") for i in range(20)]
    _write_jsonl(tmp_path / "captions.jsonl", lines)
    ids = _ids(JsonlCaptions(root=str(tmp_path), test_size=4))
    assert ids["val"] == ["0.png", "1.png", "2.png"]
    assert len(ids["test"]) == 4 and len(ids["train"]) == 13
    lines += [_line("t.png", "a cat", "test")]
    _write_jsonl(tmp_path / "full.jsonl", lines)
    full = _ids(JsonlCaptions(root=str(tmp_path), captions="full.jsonl"))
    assert full["test"] == ["t.png"] and len(full["train"]) == 17


def test_cannot_carve_more_images_than_there_are(tmp_path: Path) -> None:
    _unsplit(tmp_path, n=6)
    with pytest.raises(ValueError, match="cannot carve 3 val and 3 test images out of 6"):
        JsonlCaptions(root=str(tmp_path), val_size=3, test_size=3).read()
    # Through the data module: a DataError (a one-line user error) naming the file.
    dm = CaptionDataModule(source=JsonlCaptions(root=str(tmp_path), val_size=3, test_size=3),
                           feature_cache=False, image_size=8)
    with pytest.raises(DataError) as err:
        dm.setup("fit")
    [problem] = err.value.problems
    assert (problem.file, problem.field) == (str(tmp_path / "captions.jsonl"), "val/test")
    assert problem.message.startswith("cannot carve 3 val and 3 test images out of 6")


@pytest.mark.parametrize("name", ["val_size", "test_size"])
@pytest.mark.parametrize("value", [0, -2, 0.0, 1.0, 1.5, True, "0.1", None])
def test_carve_sizes_are_checked(name: str, value: Any) -> None:
    with pytest.raises(ValueError, match=rf"^{name} must be an image count \(an int >= 1\) or "
                                         r"a fraction .*, got "):
        JsonlCaptions(root="x", **{name: value})


def test_other_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="val_size \\+ test_size must be below 1"):
        JsonlCaptions(root="x", val_size=0.5, test_size=0.5)
    with pytest.raises(ValueError, match="needs root"):
        JsonlCaptions(root="")
    with pytest.raises(ValueError, match=r"\.jsonl or \.csv"):
        JsonlCaptions(root="x", captions="captions.json")


def test_paths_messages_and_config_form(tmp_path: Path) -> None:
    source = JsonlCaptions(root=str(tmp_path), captions="c.csv", val_size=3)
    assert ExportedJsonlCaptions is JsonlCaptions and isinstance(source, DataSource)
    assert source.table == tmp_path / "c.csv" and source.describe("val") == str(tmp_path / "c.csv")
    assert source.cache_root() == tmp_path / "features"
    assert source.config() == {"class_path": "captioning.data.tables.JsonlCaptions",
                               "init_args": {"root": str(tmp_path), "captions": "c.csv",
                                             "val_size": 3, "test_size": 0.1}}
    assert DataSource.from_config(json.loads(json.dumps(source.config()))) == source
    elsewhere = JsonlCaptions(root=str(tmp_path), captions=str(tmp_path / "x" / "c.jsonl"))
    assert elsewhere.table == tmp_path / "x" / "c.jsonl"  # an absolute path is kept


# ------------------------------------------------------------------------------------------
# Config, README, and a tiny fit + test through the command line


def test_the_jsonl_config_loads_and_takes_overrides(tmp_path: Path) -> None:
    cfg = print_config("fit", "--config", str(JSONL_CONFIG), "--data.source.root",
                        str(tmp_path), "--data.source.val_size", "3",
                        "--data.source.test_size", "0.2")
    source = cfg["data"]["source"]
    assert source["class_path"] == "captioning.data.tables.JsonlCaptions"
    assert source["init_args"] == {"root": str(tmp_path), "captions": "captions.jsonl",
                                   "val_size": 3, "test_size": 0.2}
    assert isinstance(source["init_args"]["val_size"], int)


def _readme_section() -> str:
    text = README.read_text()
    start = text.index("## Training on your own images")
    return text[start:text.index("\n## ", start + 1)]


def test_the_readme_example_parses(tmp_path: Path) -> None:
    section = _readme_section()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", section, re.S)
    layout, table, command = blocks
    root = tmp_path / "my_images"
    _write_jsonl(root / "captions.jsonl", table.splitlines())
    recs = read_captions_table(root / "captions.jsonl", root)  # the example's lines are valid
    assert {r.image_id for r in recs} == {ln.split("/", 1)[1] for ln in layout.split()
                                          if not ln.endswith(".jsonl")}
    argv = shlex.split(command.replace("\\\n", " "))
    assert argv[0] == "captioning"
    for path in [argv[i + 1] for i, a in enumerate(argv) if a == "--config"]:
        assert (REPO / path).is_file(), path
    argv = [a.replace("configs/", f"{REPO}/configs/", 1) for a in argv[1:]]
    argv[argv.index("my_images")] = str(root)
    cfg = print_config(*argv)
    assert cfg["data"]["source"]["init_args"]["root"] == str(root)
    assert "configs/data/jsonl.yaml" in command


def _draw_folder(root: Path, n: int = 24) -> None:
    """n 64px PNGs of a coloured circle or square, two captions each, in two subfolders."""
    colors = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220)}
    lines = []
    for i in range(n):
        color, shape = list(colors)[i % 3], ("circle", "square")[i // 3 % 2]
        rel = f"{shape}s/{i:02d}.png"
        image = Image.new("RGB", (64, 64), (255, 255, 255))
        box = (12 + i % 5, 14, 44 + i % 5, 46)
        draw = ImageDraw.Draw(image)
        (draw.ellipse if shape == "circle" else draw.rectangle)(box, fill=colors[color])
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        image.save(root / rel)
        lines += [_line(rel, f"a {color} {shape}"), _line(rel, f"a {shape} that is {color}")]
    _write_jsonl(root / "captions.jsonl", lines)


@pytest.mark.usefixtures("signal_handlers_restored")
def test_fit_and_test_on_a_folder_of_images(tmp_path: Path, cache_dir: Path,
                                            monkeypatch: pytest.MonkeyPatch,
                                            capsys: pytest.CaptureFixture[str],
                                            caplog: pytest.LogCaptureFixture) -> None:
    scored: list[Any] = []

    def scores(references: dict, hypotheses: dict, **kwargs: Any) -> dict[str, float]:
        # The coco-caption scorers start two JVMs (~25 s here); ids are all they need from us.
        scored.extend(hypotheses)
        assert set(references) == set(hypotheses)
        return {"BLEU-4": 0.125}  # a value only this stand-in gives

    monkeypatch.setattr(metrics, "coco_scores", scores)
    root = tmp_path / "my_images"
    _draw_folder(root)
    dm_kwargs = {"source": JsonlCaptions(root=str(root), val_size=4, test_size=4),
                 "image_size": 64, "eval_batch_size": 8, "min_word_count": 1,
                 "num_workers": 0, "pin_memory": False, "persistent_workers": False}
    ckpt_dir = tmp_path / "ckpt"
    cfg = cli_config(tmp_path / "tiny.yaml", dm_kwargs, cache_dir, ckpt_dir)
    configs = ["--config", str(JSONL_CONFIG), "--config", str(cfg)]
    assert main(["fit", *configs]) == 0
    ckpt = ckpt_dir / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["global_step"] == BATCHES
    out = tmp_path / "results"
    assert main(["test", *configs, "--ckpt_path", str(ckpt), "--model.compute_metrics", "true",
                 "--model.results_dir", str(out)]) == 0
    captions = json.loads((out / "test_captions.json").read_text())
    test_ids = {r.image_id for r in JsonlCaptions(root=str(root), val_size=4,
                                                  test_size=4).read().splits["test"]}
    assert {c["image_id"] for c in captions} == set(scored) == test_ids and len(test_ids) == 4
    assert all(isinstance(i, str) and i.endswith(".png") for i in test_ids)
    scores = json.loads((out / "test_metrics.json").read_text())
    assert scores["BLEU-4"] == 0.125 and scores["images"] == 4  # as scored, and on how many
    # A checkpoint from before carving went by each image's id (no rule recorded) carved these
    # splits otherwise: its test images now may be ones it trained on. Refused in one error.
    state = torch.load(ckpt, weights_only=True)
    assert state.pop("captioning_carving") == 2
    torch.save(state, tmp_path / "older.ckpt")
    capsys.readouterr()
    assert main(["test", *configs, "--ckpt_path", str(tmp_path / "older.ckpt")]) == 1
    errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    refusal = (f"error: {root / 'captions.jsonl'}: (splits): field 'val/test': the "
               "checkpoint's run carved these splits out by an earlier rule, so the "
               "images carved now may include images it trained on: use the version of "
               "captioning that trained it, or give the source its own val and test files")
    assert errors == [refusal]
    # A new stage (SCST) started from it: the same refusal, before any step.
    assert main(["fit", *configs, "--model.init_from", str(tmp_path / "older.ckpt"),
                 "--trainer.default_root_dir", str(tmp_path / "stage2")]) == 1
    assert [ln for ln in capsys.readouterr().err.splitlines()
            if ln.startswith("error:")] == [refusal]
    # Exported, it keeps its run's source and rule (config.json's trained_on): the same
    # refusal for the folder, evaluated or started from; today's rule is scored as before.
    for name, checkpoint in (("older", tmp_path / "older.ckpt"), ("today", ckpt)):
        assert main(["export", "--checkpoint", str(checkpoint), "--out",
                     str(tmp_path / name)]) == 0
    trained_on = json.loads((tmp_path / "older" / "config.json").read_text())["trained_on"]
    assert trained_on["carving"] is None and "JsonlCaptions" in trained_on["source"]["class_path"]
    capsys.readouterr()
    for how in (["test", *configs, "--ckpt_path", str(tmp_path / "older")],
                ["fit", *configs, "--model.init_from", str(tmp_path / "older"),
                 "--trainer.default_root_dir", str(tmp_path / "stage3")]):
        assert main(how) == 1
        assert [ln for ln in capsys.readouterr().err.splitlines()
                if ln.startswith("error:")] == [refusal]
    assert main(["test", *configs, "--ckpt_path", str(tmp_path / "today"),
                 "--model.compute_metrics", "true"]) == 0
    # A folder exported before config.json had trained_on: nothing to check it by, said so.
    unknown = tmp_path / "unknown"
    shutil.copytree(tmp_path / "today", unknown)
    config = json.loads((unknown / "config.json").read_text())
    del config["trained_on"]
    (unknown / "config.json").write_text(json.dumps(config))
    warning = (f"{unknown} records no data source (its config.json has no trained_on): "
               "whether the val/test images carved now include images its run trained on "
               "cannot be checked")
    for how in (["test", *configs, "--ckpt_path", str(unknown)],
                ["fit", *configs, "--model.init_from", str(unknown), "--trainer.max_steps", "1",
                 "--trainer.default_root_dir", str(tmp_path / "stage4")]):
        caplog.clear()
        assert main(how) == 0
        assert [r.getMessage() for r in caplog.records
                if r.levelname == "WARNING" and "records no data source" in r.getMessage()
                ] == [warning]


def test_every_problem_of_the_data_is_listed_at_once(tmp_path: Path) -> None:
    """With `on_bad_data: fail` one error lists the bad captions (in the file's order) and the
    images that are missing or cannot be read, so that one look fixes them all."""
    for i in range(6):
        Image.new("RGB", (8, 8), (40 * i, 0, 0)).save(tmp_path / f"{i}.png")
    (tmp_path / "4.png").write_bytes(b"not a png")
    (tmp_path / "5.png").unlink()
    lines = [_line(f"{i}.png", f"a red circle {i}") for i in range(6)]
    lines[2]["caption"] = " "  # line 3: found as the line is read
    lines[1]["split"] = "train"  # line 2: found once every line is read (all lines or none)
    _write_jsonl(tmp_path / "captions.jsonl", lines)
    dm = CaptionDataModule(source=JsonlCaptions(root=str(tmp_path), val_size=1, test_size=1),
                           feature_cache=False, image_size=8)
    with pytest.raises(DataError) as err:
        _ = dm.vocab
    found = [(p.entry, p.field) for p in err.value.problems]
    assert found[:2] == [("line 2", "split"), ("line 3", "caption")], found
    assert sorted((Path(p.file).name, p.field) for p in err.value.problems[2:]) == [
        ("4.png", "image"), ("5.png", "image")]
    assert "4 problems in the data" in str(err.value)
    # Not asked to check images: the captions only.
    unchecked = CaptionDataModule(source=JsonlCaptions(root=str(tmp_path), val_size=1,
                                                       test_size=1),
                                  feature_cache=False, image_size=8, validate_images=False)
    with pytest.raises(DataError) as err:
        _ = unchecked.vocab
    assert [p.entry for p in err.value.problems] == ["line 2", "line 3"]
    # No line usable: the lines' problems, not the source's "cannot carve val and test".
    _write_jsonl(tmp_path / "captions.jsonl", [{"image": f"{i}.png", "captoin": "a dog"}
                                               for i in range(6)])
    with pytest.raises(DataError) as err:
        _ = CaptionDataModule(source=JsonlCaptions(root=str(tmp_path), val_size=1, test_size=1),
                              feature_cache=False, image_size=8).vocab
    assert [(p.entry, p.field) for p in err.value.problems] == [
        (f"line {n}", "caption") for n in range(1, 7)]
