"""`captioning predict`: Trainer.predict over folders, globs and list files into one results
JSON, on one process and on 2 gloo CPU processes (DDP), with the same captions as `caption`."""

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
from PIL import Image
from tiny_runs import REPO
from trained import Trained

from captioning.callbacks import CaptionWriter
from captioning.commands import caption
from captioning.commands.predict import expand_predict_inputs, is_list_file, main
from captioning.data.predict import predict_loader
from captioning.launch import fresh_launch_env

FAST = ("--accelerator", "cpu", "--num-workers", "0")


def predict(capsys: pytest.CaptureFixture[str], *args: Any) -> tuple[int, list[str]]:
    """main(args) -> (status, stderr `error:` lines)."""
    rc = main([str(a) for a in args])
    _, err = capsys.readouterr()
    return rc, [ln for ln in err.splitlines() if ln.startswith("error:")]


def captions_by_caption(capsys: pytest.CaptureFixture[str], checkpoint: Path,
                        paths: list[Path]) -> dict[str, dict[str, Any]]:
    """`captioning caption --json` on `paths`: {path: record}."""
    rc = caption.main(["--checkpoint", str(checkpoint), "--json", "--device", "cpu",
                       *map(str, paths)])
    out, _ = capsys.readouterr()
    assert rc == 0
    return {r["path"]: r for r in map(json.loads, out.splitlines())}


def read_results(path: Path) -> list[dict[str, Any]]:
    records = json.loads(path.read_text())
    assert isinstance(records, list)
    return records


@pytest.fixture
def inputs(trained: Trained, tmp_path: Path) -> dict[str, Any]:
    """A folder (2 images), a glob's folder (2), and a list file in lists/ naming 2 by relative
    paths and 1 by an absolute one (with a comment and a blank line)."""
    imgs = trained.images
    folder, globbed, lists = tmp_path / "folder", tmp_path / "globbed", tmp_path / "lists"
    for d in (folder, globbed, lists / "rel"):
        d.mkdir(parents=True)
    shutil.copy(imgs[0], folder / "a.png")
    shutil.copy(imgs[1], folder / "b.png")
    shutil.copy(imgs[2], globbed / "c.png")
    shutil.copy(imgs[3], globbed / "d.png")
    shutil.copy(imgs[4], lists / "rel" / "e.png")
    shutil.copy(imgs[5], lists / "f.png")
    (lists / "images.txt").write_text(f"# images\nrel/e.png\n\n  f.png  \n{imgs[6]}\n")
    want = [folder / "a.png", folder / "b.png", globbed / "c.png", globbed / "d.png",
            lists / "rel" / "e.png", lists / "f.png", imgs[6]]
    return {"args": [folder, str(globbed / "*.png"), lists / "images.txt"], "want": want}


# -- one process ----------------------------------------------------------------------------------
def test_folder_glob_and_list_file_captioned_like_caption(trained: Trained, inputs: dict[str, Any],
                                                          tmp_path: Path, capsys) -> None:
    out = tmp_path / "out" / "captions.json"
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, *inputs["args"], "--out", out,
                      "--batch-size", 3, *FAST)
    assert rc == 0 and err == []
    records = read_results(out)
    assert [r["file_name"] for r in records] == [str(p) for p in inputs["want"]]
    assert set(records[0]) == {"file_name", "caption", "score"}
    want = captions_by_caption(capsys, trained.checkpoint, inputs["want"])
    for r in records:
        assert r["caption"] == want[r["file_name"]]["caption"]
        assert r["score"] == pytest.approx(want[r["file_name"]]["score"], abs=1e-4)
    assert all(r["caption"] for r in records)
    assert sorted(p.name for p in out.parent.iterdir()) == ["captions.json"]  # no shards left


def test_beam_and_length_overrides(trained: Trained, tmp_path: Path, capsys) -> None:
    paths = trained.images[:3]
    out = tmp_path / "c.json"
    rc, _ = predict(capsys, "--checkpoint", trained.checkpoint, *paths, "--out", out,
                    "--beam-size", 1, "--max-len", 4, *FAST)
    assert rc == 0
    rc = caption.main(["--checkpoint", str(trained.checkpoint), "--beam-size", "1",
                       "--max-len", "4", *map(str, paths)])
    lines = capsys.readouterr()[0].splitlines()
    assert [r["caption"] for r in read_results(out)] == [ln.split("\t")[1] for ln in lines]
    assert all(len(r["caption"].split()) <= 4 for r in read_results(out))


def test_num_captions_lists_each_images_best_beams_as_caption_does(
        trained: Trained, tmp_path: Path, capsys) -> None:
    """`--num-captions 3 --beam-size 3`: every record keeps its best caption and score, and a
    `captions` list of the 3 best beams, the same as `caption --num-captions 3 --json`; with
    `--alphas` the maps are the best caption's. More captions than beams is one line."""
    paths = trained.images[:3]
    out = tmp_path / "n.json"
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, *paths, "--out", out,
                      "--num-captions", 3, "--beam-size", 3, "--alphas", *FAST)
    assert rc == 0 and err == []
    rc = caption.main(["--checkpoint", str(trained.checkpoint), "--num-captions", "3",
                       "--beam-size", "3", "--json", "--device", "cpu", *map(str, paths)])
    want = {r["path"]: r for r in map(json.loads, capsys.readouterr()[0].splitlines())}
    records = read_results(out)
    assert [r["file_name"] for r in records] == [str(p) for p in paths]
    for r in records:
        w = want[r["file_name"]]
        assert [c["caption"] for c in r["captions"]] == [c["caption"] for c in w["captions"]]
        assert [c["score"] for c in r["captions"]] == pytest.approx(
            [c["score"] for c in w["captions"]], abs=1e-4)
        assert r["caption"] == r["captions"][0]["caption"] == w["caption"]
        assert r["captions"][0]["score"] >= r["captions"][-1]["score"]
        maps = np.load(r["alphas"])  # a special token such as <unk> keeps its step
        assert [w for w in maps["words"] if not w.startswith("<")] == r["caption"].split()
        assert maps["alphas"].shape[0] == len(maps["words"])
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, paths[0], "--out",
                      tmp_path / "m.json", "--num-captions", 4, "--beam-size", 3, *FAST)
    assert rc == 2 and err == ["error: --num-captions 4 is more than the beam size 3: raise "
                               "--beam-size, or --sample"]


def test_bad_images_reported_and_skipped(trained: Trained, tmp_path: Path, capsys) -> None:
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    missing = tmp_path / "missing.jpg"
    good = trained.images[:3]
    out = tmp_path / "c.json"
    # batch size 2: the second batch (corrupt, missing) has no image left
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, good[0], good[1], corrupt,
                      missing, good[2], "--out", out, "--batch-size", 2, *FAST)
    assert rc == 1
    assert [r["file_name"] for r in read_results(out)] == [str(p) for p in good]
    assert len(err) == 2, err
    assert err[0].startswith(f"error: {corrupt}: ")
    assert err[1] == f"error: {missing}: file does not exist"


def test_alphas_match_caption_length_and_grid(trained: Trained, tmp_path: Path, capsys) -> None:
    paths = trained.images[:4]
    out = tmp_path / "c.json"
    rc, _ = predict(capsys, "--checkpoint", trained.checkpoint, *paths, "--out", out,
                    "--alphas", "--batch-size", 3, *FAST)
    assert rc == 0
    gh, gw = trained.module.captioner.grid
    records = read_results(out)
    assert sorted(p.name for p in (tmp_path / "c_alphas").iterdir()) == sorted(
        p.with_suffix(".npz").name for p in paths)
    for r in records:
        with np.load(r["alphas"]) as z:
            alphas, words = z["alphas"], list(z["words"])
        assert alphas.shape == (len(words), gh, gw) and alphas.dtype == np.float32
        assert len(words) >= len(r["caption"].split()) >= 1  # words keep specials like <unk>
        assert [w for w in words if not w.startswith("<")] == r["caption"].split()
        np.testing.assert_allclose(alphas.sum(axis=(1, 2)), 1.0, atol=1e-4)  # soft attention


def test_overlays_are_readable_pngs(trained: Trained, tmp_path: Path, capsys) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    shutil.copy(trained.images[0], a / "x.png")
    shutil.copy(trained.images[1], b / "x.png")
    out, ov = tmp_path / "c.json", tmp_path / "ov"
    rc, _ = predict(capsys, "--checkpoint", trained.checkpoint, a / "x.png", b / "x.png",
                    "--out", out, "--overlay", ov, *FAST)  # caption's name for --overlays
    assert rc == 0
    records = read_results(out)
    assert sorted(p.name for p in ov.iterdir()) == ["x-2.png", "x.png"]  # caption's names
    assert [Path(r["overlay"]).name for r in records] == ["x.png", "x-2.png"]
    for r in records:
        strip = np.asarray(Image.open(r["overlay"]))
        n = len(r["caption"].split())
        assert strip.shape[0] == 64 + 14 and strip.shape[1] >= 64 * (n + 1)
        assert strip[:64].std() > 1


def test_outputs_never_replace_an_input_image(trained: Trained, tmp_path: Path, capsys) -> None:
    """`--out` naming an input image is refused (it became the results); overlays written into
    the inputs' folder take the next free name where a strip's name is an input's."""
    img = tmp_path / "a.png"
    shutil.copy(trained.images[0], img)
    kept = img.read_bytes()
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, tmp_path, "--out", img, *FAST)
    assert rc == 2 and err == [f"error: --out {img}: is one of the input images; give another "
                               "file to write"]
    rc, _ = predict(capsys, "--checkpoint", trained.checkpoint, img, "--out",
                    tmp_path / "c.json", "--overlays", tmp_path, *FAST)
    assert rc == 0 and img.read_bytes() == kept
    assert [Path(r["overlay"]).name for r in read_results(tmp_path / "c.json")] == ["a-2.png"]


@pytest.mark.parametrize("precision", ["16-true", "bf16-true", "64-true"])
def test_every_true_precision_captions(trained: Trained, tmp_path: Path, capsys,
                                       precision: str) -> None:
    """`--precision` 16-true and bf16-true (the model and images cast) stopped with a dtype
    error (a float16 grid was taken for a cached one and widened; beam buffers took the default
    dtype); 64-true gives float32's captions."""
    images, out = trained.images[:3], tmp_path / "c.json"
    results = {}
    for p in ("32-true", precision):
        rc, err = predict(capsys, "--checkpoint", trained.checkpoint, *images, "--out", out,
                          "--precision", p, "--num-captions", "2", "--alphas", *FAST)
        assert rc == 0 and err == [], err
        results[p] = read_results(out)
    for r in results[precision]:
        assert r["caption"] and len(r["captions"]) == 2 and np.isfinite(r["score"])
        with np.load(r["alphas"]) as saved:  # α maps stay float32
            assert saved["alphas"].dtype == np.float32
    if precision == "64-true":
        def texts(p: str) -> list[list[str]]:
            return [[c["caption"] for c in r["captions"]] for r in results[p]]

        assert texts(precision) == texts("32-true")


def test_a_killed_runs_temporaries_are_removed_by_the_next_run(
        trained: Trained, tmp_path: Path, capsys) -> None:
    """A run killed while writing strips, maps or the JSON left their temporaries; the next
    `predict` (and `caption --overlay`) into the same folders removes those of dead writers
    and leaves a live writer's alone."""
    from captioning.atomic import HOST

    dead, live = 999_999_999, os.getpid()  # above any pid_max: no such process
    out, overlays = tmp_path / "out" / "c.json", tmp_path / "strips"
    alphas = out.with_name("c_alphas")
    left = {folder: folder / f".x.png.{HOST}.{dead}.0123abcd.tmp"
            for folder in (out.parent, overlays, alphas)}
    kept = overlays / f".y.png.{HOST}.{live}.0123abcd.tmp"
    for f in [*left.values(), kept]:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(b"half a file")
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, trained.images[0], "--out",
                      out, "--alphas", "--overlays", overlays, *FAST)
    assert rc == 0 and err == []
    assert not any(f.exists() for f in left.values()) and kept.exists()
    left[overlays].write_bytes(b"half a file")
    assert caption.main(["--checkpoint", str(trained.checkpoint), "--overlay", str(overlays),
                         "--device", "cpu", str(trained.images[0])]) == 0
    assert not left[overlays].exists() and kept.exists()


def test_a_full_disk_names_the_file_it_could_not_write(
        trained: Trained, tmp_path: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno
    import io

    class Full(io.StringIO):
        def write(self, text: str) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

    setup = CaptionWriter.setup

    def full_setup(self: CaptionWriter, *args: Any, **kwargs: Any) -> None:
        setup(self, *args, **kwargs)
        if self._shard is not None:
            self._shard.close()
            self._shard = Full()

    monkeypatch.setattr(CaptionWriter, "setup", full_setup)
    from captioning.cli import main as captioning

    out = tmp_path / "c.json"
    rc = captioning(["predict", "--checkpoint", str(trained.checkpoint), str(trained.images[0]),
                     "--out", str(out), *FAST])
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error:")]
    assert rc == 1
    assert err == [f"error: [Errno 28] No space left on device: '{out}.rank0.jsonl'"]
    assert list(tmp_path.iterdir()) == []  # no shard or result left


def test_usage_errors(trained: Trained, tmp_path: Path, capsys) -> None:
    img, out = trained.images[0], tmp_path / "c.json"
    rc, err = predict(capsys, "--checkpoint", tmp_path / "none.ckpt", img, "--out", out)
    assert rc == 2 and len(err) == 1 and "does not exist" in err[0]
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, "--out", out)
    assert rc == 2 and "no inputs" in err[0]
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, tmp_path / "none.txt",
                      "--out", out)
    assert rc == 2 and err == [f"error: {tmp_path / 'none.txt'}: list file does not exist",
                               "error: no images to caption"]
    for bad in (("--devices", "two"), ("--batch-size", "0"), ("--num-workers", "-1"),
                ("--out", tmp_path)):
        rc, err = predict(capsys, "--checkpoint", trained.checkpoint, img, "--out", out, *bad)
        assert rc == 2 and len(err) == 1, (bad, err)
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    for flag, value in (("--out", a_file / "c.json"), ("--overlays", a_file / "ov"),
                        ("--overlays", a_file)):
        rc, err = predict(capsys, "--checkpoint", trained.checkpoint, img, "--out", out,
                          flag, value)
        assert rc == 2 and err == [f"error: {flag} {value}: {a_file} is a file, not a folder"]
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, img, "--out", out,
                      "--precision", "17-odd", *FAST)
    assert rc == 2 and "trainer" in err[0]
    # in-process DDP would re-run pytest's command line once per rank: refused
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, img, "--out", out,
                      "--devices", "2", "--strategy", "ddp", *FAST)
    assert rc == 2 and "shell" in err[0]
    assert main(["--help"]) == 0
    capsys.readouterr()
    assert not out.exists()


def test_list_files_are_recognised(tmp_path: Path) -> None:
    assert is_list_file("@names") and is_list_file("x.TXT") and is_list_file("a/b.lst")
    assert not is_list_file("x.png") and not is_list_file("folder")
    (tmp_path / "x.png").write_bytes(b"")
    (tmp_path / "names").write_text("x.png\nx.png\n")
    (tmp_path / "empty.lst").write_text("# nothing\n")
    got = expand_predict_inputs([f"@{tmp_path / 'names'}", str(tmp_path / "empty.lst"),
                                 str(tmp_path / "x.png")])
    assert got.paths == [tmp_path / "x.png"]  # each path once
    assert got.problems == [f"{tmp_path / 'empty.lst'}: list file names no images"]


def test_a_list_entry_that_names_nothing_is_reported_with_its_file_and_line(
        tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(b"")
    (tmp_path / "pics").mkdir()
    (tmp_path / "pics" / "b.png").write_bytes(b"")
    listing = tmp_path / "images.txt"
    listing.write_text("\ufeffa.png\n# a comment\nmissing.png\npics/*.png\nnone/*.png\n",
                       encoding="utf-8")  # with a byte-order mark, as Notepad writes it
    got = expand_predict_inputs([str(listing)])
    assert got.paths == [tmp_path / "a.png", tmp_path / "pics" / "b.png"]
    assert got.problems == [
        f"{listing}, line 3: {tmp_path / 'missing.png'}: image file does not exist",
        f"{listing}, line 5: {tmp_path / 'none/*.png'}: pattern matched no images"]


def test_short_lists_give_every_rank_an_item(tmp_path: Path, write_png) -> None:
    good = write_png(tmp_path / "a.png", size=(64, 64))
    bad = tmp_path / "bad.png"
    bad.write_text("not an image")
    batches = list(predict_loader([good, bad], 64, batch_size=1, world_size=4))
    assert [b.indices for b in batches] == [[0], [], [0], []]  # items 2, 3 repeat 0, 1
    assert [[i for i, *_ in b.failures] for b in batches] == [[], [1], [], []]  # reported once
    assert batches[1].images.shape == (0, 3, 64, 64)


def test_merge_keeps_each_input_once_in_order(tmp_path: Path) -> None:
    writer = CaptionWriter(tmp_path / "c.json")

    def rec(i: int, name: str) -> dict[str, Any]:
        return {"index": i, "file_name": f"{name}.png", "caption": name, "score": 0.0}

    failed = {"index": 3, "file_name": "d.png", "error": "d.png: not an image"}
    shards = [[rec(2, "c"), rec(0, "a"), failed], [rec(1, "b"), rec(2, "c"), failed]]
    for rank, lines in enumerate(shards):  # a padding sampler repeats inputs across ranks
        writer.shard_path(rank).write_text("".join(json.dumps(ln) + "\n" for ln in lines))
    assert writer.merge(2) == {"captioned": 3, "failed": 1}
    assert [r["caption"] for r in read_results(tmp_path / "c.json")] == ["a", "b", "c"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.json"]


# -- DDP: 2 gloo CPU processes --------------------------------------------------------------------
def test_ddp_two_processes_merge_every_image_once(trained: Trained, tmp_path: Path,
                                                  capsys) -> None:
    images = tmp_path / "images"
    images.mkdir()
    for p in trained.images[:6]:
        shutil.copy(p, images / p.name)
    (images / "zz_bad.png").write_text("not an image")  # 7 inputs: odd, one fails
    out = tmp_path / "ddp" / "captions.json"
    env = {**fresh_launch_env(os.environ), "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "captioning.cli", "predict", "--checkpoint",
         str(trained.checkpoint), str(images), "--out", str(out), "--batch-size", "2",
         "--devices", "2", "--strategy", "ddp", *FAST],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-4000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("error:")]
    bad = images / "zz_bad.png"
    assert len(errors) == 1 and errors[0].startswith(f"error: {bad}: not an image"), errors
    assert "Starting with 2 processes" in proc.stderr  # two ranks, each with its shard
    assert "captioned 6 image(s)" in proc.stderr and "1 failed" in proc.stderr
    records = read_results(out)
    good = sorted(images.glob("test_*.png"))
    assert [r["file_name"] for r in records] == [str(p) for p in good]  # once each, in order
    assert sorted(p.name for p in out.parent.iterdir()) == ["captions.json"]  # shards removed
    single = tmp_path / "single.json"
    rc, _ = predict(capsys, "--checkpoint", trained.checkpoint, *good, "--out", single, *FAST)
    assert rc == 0
    want = read_results(single)
    assert [r["caption"] for r in records] == [r["caption"] for r in want]
    assert [r["score"] for r in records] == pytest.approx([r["score"] for r in want], abs=1e-4)


def test_predict_help_does_not_import_torch() -> None:
    """The command parses its arguments before torch and Lightning are imported."""
    code = ("import sys\nfrom captioning.commands.predict import main\n"
            "assert main(['--help']) == 0\nassert 'torch' not in sys.modules, 'torch'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


def test_sampled_captions(trained: Trained, tmp_path: Path, capsys) -> None:
    """`--sample` (with `--temperature`) writes one sampled caption per image, as `caption
    --sample` draws them; `--temperature` without `--sample` is one line, before any work."""
    import torch

    out = tmp_path / "s.json"
    torch.manual_seed(0)
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, *trained.images[:3],
                      "--out", out, "--sample", "--temperature", "1.5", "--max-len", "6", *FAST)
    assert rc == 0 and err == []
    records = read_results(out)
    assert [Path(r["file_name"]).name for r in records] == [p.name for p in trained.images[:3]]
    assert all(isinstance(r["caption"], str) and len(r["caption"].split()) <= 6
               for r in records)
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, *trained.images[:2], "--out",
                      tmp_path / "two.json", "--sample", "--num-captions", 2, *FAST)
    assert rc == 0 and err == []
    assert all(len(r["captions"]) == 2 and r["caption"] == r["captions"][0]["caption"]
               and r["score"] == r["captions"][0]["score"]
               for r in read_results(tmp_path / "two.json"))
    rc, err = predict(capsys, "--checkpoint", trained.checkpoint, trained.images[0],
                      "--out", tmp_path / "t.json", "--temperature", "1.5", *FAST)
    assert rc == 2 and err == ["error: --temperature must be > 0, with --sample (got 1.5 "
                               "without --sample)"]
    assert not (tmp_path / "t.json").exists()
