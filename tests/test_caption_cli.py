"""`captioning caption`: end to end on a tiny trained checkpoint (in-process and one subprocess)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from trained import RunsCode, Trained

from captioning.checkpoint import save_inference_checkpoint
from captioning.commands.caption import expand_inputs, main, overlay_names
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig

SCRIPT = Path(sys.executable).parent / "captioning"
HEAVY = ("lightning", "wandb", "pycocoevalcap", "nltk")


def run(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, list[str], list[str]]:
    """main(args) -> (status, stdout lines, stderr lines that are not log records)."""
    rc = main([str(a) for a in args])
    out, err = capsys.readouterr()
    errors = [ln for ln in err.splitlines() if not ln.startswith(("INFO ", "DEBUG "))]
    return rc, out.splitlines(), errors


def parse(lines: list[str]) -> dict[str, str]:
    pairs = [ln.split("\t") for ln in lines]
    assert all(len(p) == 2 for p in pairs), lines
    return dict(pairs)  # type: ignore[arg-type]


# -- output ---------------------------------------------------------------------------------------
def test_text_output_matches_the_lightning_module(trained: Trained, capsys) -> None:
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, *trained.images)
    assert rc == 0 and err == []
    assert [ln.split("\t")[0] for ln in out] == [str(p) for p in trained.images]
    want = trained.captions(trained.images)  # CaptioningModule.generate: the one decoding path
    assert list(parse(out).values()) == want
    assert all(want)


def test_json_lines(trained: Trained, capsys) -> None:
    paths = trained.images[:3]
    rc, out, _ = run(capsys, "--checkpoint", trained.checkpoint, "--json", "--batch-size", 2,
                     *paths)
    assert rc == 0
    records = [json.loads(ln) for ln in out]
    assert [r["path"] for r in records] == [str(p) for p in paths]
    assert [r["caption"] for r in records] == trained.captions(paths)
    with torch.no_grad():
        scores = trained.module.generate(trained.batch(paths)).scores.tolist()
    for r, s in zip(records, scores):
        assert r["tokens"] == r["caption"].split()
        assert isinstance(r["finished"], bool)
        assert r["score"] == pytest.approx(s, abs=1e-4)


@pytest.mark.parametrize("beam", [1, 5])
def test_beam_size_option(trained: Trained, capsys, beam: int) -> None:
    paths = trained.images[:4]
    rc, out, _ = run(capsys, "--checkpoint", trained.checkpoint, "--beam-size", beam,
                     "--max-len", 10, *paths)
    assert rc == 0
    want = trained.captions(paths, DecodeConfig(strategy="beam", beam_size=beam, max_len=10))
    assert list(parse(out).values()) == want
    if beam == 1:  # beam 1 is greedy search
        assert want == trained.captions(paths, DecodeConfig(strategy="greedy", max_len=10))


# -- inputs ---------------------------------------------------------------------------------------
@pytest.fixture
def folder(trained: Trained, tmp_path: Path) -> Path:
    """b.png, a.PNG, c.jpg (+ notes.txt and a sub-folder, both ignored)."""
    d = tmp_path / "imgs"
    d.mkdir()
    shutil.copy(trained.images[0], d / "b.png")
    shutil.copy(trained.images[1], d / "a.PNG")
    Image.open(trained.images[2]).convert("RGB").save(d / "c.jpg", quality=95)
    (d / "notes.txt").write_text("not an image")
    (d / "sub").mkdir()
    shutil.copy(trained.images[3], d / "sub" / "d.png")
    return d


def test_directory_input(trained: Trained, folder: Path, capsys) -> None:
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, folder)
    assert rc == 0 and err == []
    got = parse(out)
    assert list(got) == [str(folder / n) for n in ("a.PNG", "b.png", "c.jpg")]
    assert got[str(folder / "b.png")] == trained.captions([trained.images[0]])[0]


def test_glob_input(trained: Trained, folder: Path, capsys) -> None:
    rc, out, _ = run(capsys, "--checkpoint", trained.checkpoint, str(folder / "*.png"),
                     str(folder / "**" / "d.png"))
    assert rc == 0
    assert list(parse(out)) == [str(folder / "b.png"), str(folder / "sub" / "d.png")]


def test_bad_files_are_reported_and_the_rest_captioned(trained: Trained, tmp_path: Path,
                                                      capsys) -> None:
    missing = tmp_path / "missing.jpg"
    text = tmp_path / "fake.png"
    text.write_text("this is not a PNG")
    good = trained.images[:2]
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, good[0], missing, text,
                       good[1])
    assert rc == 1
    assert list(parse(out)) == [str(p) for p in good]
    assert list(parse(out).values()) == trained.captions(good)
    assert len(err) == 2, err
    assert str(missing) in err[0] and "does not exist" in err[0]
    assert str(text) in err[1] and "not an image" in err[1]
    assert not any("Traceback" in ln for ln in err)


def test_nothing_to_caption(trained: Trained, tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, empty)
    assert rc == 2 and out == [] and str(empty) in err[0] and "no images" in err[0]
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, str(tmp_path / "*.jpg"))
    assert rc == 2 and out == [] and "matched no images" in err[0]
    rc, _, err = run(capsys, "--checkpoint", trained.checkpoint)
    assert rc == 2 and "no inputs" in err[0]


def test_empty_folder_among_images_fails_but_captions_the_rest(trained: Trained,
                                                              tmp_path: Path, capsys) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, out, err = run(capsys, "--checkpoint", trained.checkpoint, empty, trained.images[0])
    assert rc == 1
    assert parse(out) == {str(trained.images[0]): trained.captions([trained.images[0]])[0]}
    [line] = err
    assert line.startswith(f"error: {empty}: directory has no images ("), line


def test_missing_or_refused_checkpoint(trained: Trained, tmp_path: Path, capsys) -> None:
    rc, out, err = run(capsys, "--checkpoint", tmp_path / "none.ckpt", trained.images[0])
    assert rc == 2 and out == [] and len(err) == 1
    assert str(tmp_path / "none.ckpt") in err[0] and "does not exist" in err[0]
    marker = tmp_path / "ran"
    torch.save({"state_dict": {}, "x": RunsCode(marker)}, tmp_path / "evil.ckpt")
    rc, out, err = run(capsys, "--checkpoint", tmp_path / "evil.ckpt", trained.images[0])
    assert rc == 2 and out == [] and len(err) == 1 and "refused" in err[0]
    assert not marker.exists()


def test_usage_errors(trained: Trained, tmp_path: Path, capsys) -> None:
    assert run(capsys, "--checkpoint", trained.checkpoint, "--beam-size", 0,
               trained.images[0])[0] == 2
    (tmp_path / "a-file").write_text("x")  # --overlay naming a file: one line, not one an image
    for folder in (tmp_path / "a-file", tmp_path / "a-file" / "ov"):
        assert run(capsys, "--checkpoint", trained.checkpoint, "--overlay", folder,
                   *trained.images[:2]) == (2, [], [f"error: --overlay {folder}: "
                                                    f"{tmp_path / 'a-file'} is a file, not a "
                                                    "folder"])
    assert main(["--no-such-option"]) == 2
    assert main(["--help"]) == 0
    capsys.readouterr()
    if not torch.cuda.is_available():
        rc, _, err = run(capsys, "--checkpoint", trained.checkpoint, "--device", "cuda",
                         trained.images[0])
        assert rc == 2 and "CUDA" in err[0]


# -- overlays -------------------------------------------------------------------------------------
def test_overlay_one_png_per_image(trained: Trained, tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(trained.images[0], a / "x.png")
    shutil.copy(trained.images[1], b / "x.png")
    shutil.copy(trained.images[2], a / "y.png")
    out_dir = tmp_path / "overlays"
    rc, out, _ = run(capsys, "--checkpoint", trained.checkpoint, "--json", "--overlay",
                     out_dir, a / "x.png", b / "x.png", a / "y.png")
    assert rc == 0
    records = [json.loads(ln) for ln in out]
    assert sorted(p.name for p in out_dir.iterdir()) == ["x-2.png", "x.png", "y.png"]
    assert [Path(r["overlay"]).name for r in records] == ["x.png", "x-2.png", "y.png"]
    for r in records:
        strip = np.asarray(Image.open(r["overlay"]))
        n_words = len(r["tokens"])
        assert strip.shape == (64 + 14, 64 * (n_words + 1), 3)
        panels = strip[:64].reshape(64, n_words + 1, 64, 3)
        assert panels.mean() > 20
        for t in range(n_words + 1):  # the image and every word's overlay have content
            assert panels[:, t].std() > 1, t


def test_overlays_into_the_image_folder_leave_the_inputs_alone(trained: Trained, tmp_path: Path,
                                                               capsys) -> None:
    """`--overlay` naming the folder of the inputs: a strip whose name is an input's gets the
    next free name (it replaced the input image)."""
    for i, name in enumerate(("a.png", "b.jpg")):
        Image.open(trained.images[i]).convert("RGB").save(tmp_path / name)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc, out, _ = run(capsys, "--checkpoint", trained.checkpoint, "--json", "--overlay", tmp_path,
                     tmp_path / "a.png", tmp_path / "b.jpg")
    assert rc == 0
    assert [Path(json.loads(ln)["overlay"]).name for ln in out] == ["a-2.png", "b.png"]
    assert {n: (tmp_path / n).read_bytes() for n in before} == before
    assert overlay_names([tmp_path / "a.png", Path("elsewhere/a.png")], tmp_path) == [
        "a-2.png", "a-3.png"]
    # through symlinks: neither a link in the folder nor the file a link elsewhere reads
    (tmp_path / "z").mkdir()
    (tmp_path / "z" / "real.png").write_bytes(b"")
    (tmp_path / "link.png").symlink_to(tmp_path / "z" / "real.png")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "alias.png").symlink_to(tmp_path / "a.png")
    assert overlay_names([tmp_path / "link.png"], tmp_path) == ["link-2.png"]
    assert overlay_names([tmp_path / "other" / "alias.png", tmp_path / "z" / "a.png"],
                         tmp_path) == ["alias.png", "a-2.png"]


def test_unreadable_folders_and_symlink_loops_are_input_problems(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A folder that cannot be listed, and a symlink loop, are problems of that input (one
    line each), not tracebacks."""
    loop = tmp_path / "loop.png"
    loop.symlink_to(tmp_path / "loop2.png")
    (tmp_path / "loop2.png").symlink_to(loop)
    assert expand_inputs([str(loop)]).paths == [loop]  # the loader reports it, as a file
    locked = tmp_path / "locked"
    locked.mkdir()
    listing = Path.iterdir

    def iterdir(self: Path) -> Any:  # as without read permission (the tests may run as root)
        if self == locked:
            raise PermissionError(13, "Permission denied", str(self))
        return listing(self)

    monkeypatch.setattr(Path, "iterdir", iterdir)
    inputs = expand_inputs([str(locked)])
    assert inputs.paths == []
    assert inputs.problems == [f"{locked}: cannot read the folder (Permission denied)"]


def test_overlay_marks_hard_attention_locations(trained: Trained, tmp_path: Path,
                                               capsys) -> None:
    torch.manual_seed(0)
    cfg = CaptionerConfig(vocab_size=len(trained.vocab), backbone="resnet18", grid_size=3,
                          image_size=64, embed_dim=16, hidden_dim=16, attn_dim=16, dropout=0.0,
                          attention="hard", hard_decode="argmax")
    ckpt = save_inference_checkpoint(tmp_path / "hard.pt", Captioner(cfg).eval(), trained.vocab,
                                     decode=DecodeConfig(beam_size=2, max_len=4))
    img = tmp_path / "blue.png"
    Image.new("RGB", (80, 64), (40, 60, 200)).save(img)
    # --overlays: predict's name for --overlay, which caption takes too
    rc, out, _ = run(capsys, "--checkpoint", ckpt, "--json", "--overlays", tmp_path / "ov", img)
    assert rc == 0
    rec = json.loads(out[0])
    strip = np.asarray(Image.open(rec["overlay"]))
    words = len(strip[0]) // 64 - 1
    assert words >= 1
    white = (strip[:64, 64:] == 255).all(axis=-1)  # the marker's white ring (never in viridis)
    assert white.sum() > 0


# -- pure helpers ---------------------------------------------------------------------------------
def test_expand_inputs_dedupes_and_overlay_names_are_unique(tmp_path: Path) -> None:
    for name in ("x.png", "x.jpg", "X.PNG"):
        (tmp_path / name).write_bytes(b"\x89PNG")
    inputs = expand_inputs([str(tmp_path), str(tmp_path / "x.png"), str(tmp_path / "*.jpg")])
    assert [p.name for p in inputs.paths] == ["X.PNG", "x.jpg", "x.png"]
    assert inputs.problems == []
    assert overlay_names(inputs.paths) == ["X.png", "x-2.png", "x-3.png"]
    assert overlay_names([Path("a/x-2.png"), Path("x.png"), Path("b/x.png")]) == [
        "x-2.png", "x.png", "x-3.png"]
    # A folder whose images are all in sub-folders says how to reach them, and that works.
    (tmp_path / "nested" / "dogs").mkdir(parents=True)
    (tmp_path / "nested" / "dogs" / "1.png").write_bytes(b"\x89PNG")
    nested = expand_inputs([str(tmp_path / "nested")])
    assert nested.paths == [] and nested.problems[0].endswith(
        f"; its sub-folders have some: pass '{tmp_path / 'nested' / '**'}' (quoted) for those")
    assert expand_inputs([str(tmp_path / "nested" / "**")]).paths == [
        tmp_path / "nested" / "dogs" / "1.png"]


# -- subprocesses ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def console_run(trained: Trained, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One run of the installed `captioning caption` script, with import timings on."""
    tmp = tmp_path_factory.mktemp("console")
    missing = tmp / "missing.png"
    env = {**os.environ, "PYTHONPROFILEIMPORTTIME": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(SCRIPT), "caption", "--checkpoint", str(trained.checkpoint),
                        "--overlay", str(tmp / "ov"), *map(str, trained.images[:3]), str(missing)],
                       capture_output=True, text=True, env=env, timeout=120)
    err = [ln for ln in p.stderr.splitlines() if not ln.startswith("import time:")]
    imported = {ln.split("|")[-1].strip() for ln in p.stderr.splitlines()
                if ln.startswith("import time:")}
    return {"rc": p.returncode, "out": p.stdout.splitlines(), "err": err, "imported": imported,
            "overlays": sorted((tmp / "ov").glob("*.png")), "missing": missing}


def test_console_script(trained: Trained, console_run: dict[str, Any]) -> None:
    assert console_run["rc"] == 1
    assert list(parse(console_run["out"]).values()) == trained.captions(trained.images[:3])
    errors = [ln for ln in console_run["err"] if ln.startswith("error:")]
    assert errors == [f"error: {console_run['missing']}: file does not exist"]
    assert not any("Traceback" in ln for ln in console_run["err"])
    assert len(console_run["overlays"]) == 3


def test_caption_command_imports_no_metrics_or_logging_packages(
        console_run: dict[str, Any]) -> None:
    top = {name.split(".")[0] for name in console_run["imported"]}
    # `captioning.cli` loads the command with importlib.import_module, which -X importtime
    # does not list; the checkpoint loader it imports at run time shows the profile is whole
    assert "captioning.checkpoint" in console_run["imported"]
    assert not top & {"wandb", "pycocoevalcap", "nltk"}


def test_caption_command_does_not_import_lightning(console_run: dict[str, Any]) -> None:
    assert "lightning" not in {name.split(".")[0] for name in console_run["imported"]}


def test_loader_does_not_import_heavy_packages(trained: Trained) -> None:
    code = ("import sys, json\n"
            "from captioning.checkpoint import load_checkpoint\n"
            f"m = load_checkpoint({str(trained.checkpoint)!r})\n"
            "print(json.dumps(sorted(n for n in sys.modules if n.split('.')[0] in "
            f"{HEAVY!r})))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout) == []


def test_a_nul_byte_in_an_input_or_list_entry_is_one_line(tmp_path: Path) -> None:
    from captioning.commands.predict import expand_predict_inputs

    good = tmp_path / "ok.png"
    Image.new("RGB", (8, 8)).save(good)
    listing = tmp_path / "images.txt"
    listing.write_bytes(b"ok.png\nbad\0name.png\n")
    for inputs in (expand_inputs([str(good), "bad\0name.png"]),
                   expand_predict_inputs([str(listing)])):
        assert [p.name for p in inputs.paths] == ["ok.png"]
        [problem] = inputs.problems
        assert "bad\\x00name.png" in problem and "NUL byte" in problem and "\n" not in problem
