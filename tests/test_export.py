"""Exported model folders: `captioning export`, `Captioner.save_pretrained` / `from_pretrained`,
`load_checkpoint(folder)`; identical decoding, no pickle, one-line errors naming the file."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import needs_java
from safetensors.torch import load_file, save_file
from trained import Trained

from captioning.checkpoint import (
    CheckpointError,
    is_pretrained_dir,
    load_checkpoint,
    save_inference_checkpoint,
)
from captioning.cli import main as cli_main
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.pretrained import (
    CARD_FILE,
    CONFIG_FILE,
    FORMAT,
    VOCAB_FILE,
    WEIGHTS_FILE,
    PretrainedError,
    write_model_folder,
)
from captioning.vocab import SPECIALS, Vocabulary

WORDS = ["a", "red", "blue", "green", "circle", "square", "left", "of", "the", "small"]
NET = CaptionerConfig(vocab_size=len(SPECIALS) + len(WORDS), backbone="resnet18", weights=None,
                      grid_size=2, image_size=64, embed_dim=8, hidden_dim=16, attn_dim=8,
                      dropout=0.0)
DECODE = DecodeConfig(beam_size=2, max_len=7)
FILES = {CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE, CARD_FILE}


@dataclass
class Tiny:
    """A random-weight tiny captioner, its Lightning-style checkpoint in a run folder (with
    test_metrics.json), and the folder `captioning export` made of it."""

    captioner: Captioner
    vocab: Vocabulary
    checkpoint: Path
    folder: Path
    images: torch.Tensor


def export(*args: Any) -> int:
    return cli_main(["export", *map(str, args)])


def lightning_like_checkpoint(captioner: Captioner, vocab: Vocabulary, run: Path) -> Path:
    """What training saves, in the keys the exporter reads (weights, config, vocabulary,
    hyperparameters, the data module's settings, a ModelCheckpoint state)."""
    ckpt = run / "checkpoints" / "best-03.ckpt"
    ckpt.parent.mkdir(parents=True)
    net = replace(NET, weights="IMAGENET1K_V1").to_dict()  # the backbone it started from
    torch.save({
        "epoch": 3, "global_step": 40,
        "state_dict": {f"captioner.{k}": v for k, v in captioner.state_dict().items()},
        "hyper_parameters": {"decoder_lr": 0.01, "net": net, "decode": DECODE.to_dict(),
                             "_instantiator": "lightning.pytorch.cli.instantiate_module"},
        "datamodule_hyper_parameters": {
            "image_size": 64, "min_word_count": 2, "source": {
                "class_path": "captioning.data.sources.ShapesSource",
                "init_args": {"root": "data/shapes", "num_train": 24}}},
        "callbacks": {"ModelCheckpoint{'monitor': 'val/BLEU-4'}": {
            "monitor": "val/BLEU-4", "best_model_score": torch.tensor(0.4321),
            "current_score": torch.tensor(0.4321), "best_model_path": str(ckpt)}},
        "captioning_vocab": vocab.to_dict(), "captioning_model_config": net,
    }, ckpt)
    (run / "test_metrics.json").write_text(json.dumps({"BLEU-4": 0.2468, "CIDEr": 1.375}))
    return ckpt


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Tiny:
    torch.manual_seed(0)
    vocab = Vocabulary([*SPECIALS, *WORDS])
    captioner = Captioner(NET).eval()
    tmp = tmp_path_factory.mktemp("export")
    ckpt = lightning_like_checkpoint(captioner, vocab, tmp / "run")
    assert export("--checkpoint", ckpt, "--out", tmp / "model") == 0
    return Tiny(captioner, vocab, ckpt, tmp / "model", torch.randn(3, 3, 64, 64))


def generate(captioner: Captioner, images: torch.Tensor, decode: DecodeConfig) -> Any:
    with torch.no_grad():
        return captioner.generate(images, decode)


def assert_same(a: Any, b: Any) -> None:
    assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
    torch.testing.assert_close(a.scores, b.scores)
    torch.testing.assert_close(a.alphas, b.alphas)


# -- the round trip -------------------------------------------------------------------------------
def test_export_writes_the_folder(tiny: Tiny) -> None:
    assert {p.name for p in tiny.folder.iterdir()} == FILES  # no temporary files left
    assert is_pretrained_dir(tiny.folder) and not is_pretrained_dir(tiny.checkpoint)
    config = json.loads((tiny.folder / CONFIG_FILE).read_text())
    digests = config.pop("sha256")
    assert config == {"format": FORMAT, "format_version": 1, "model": NET.to_dict(),
                      "decode": DECODE.to_dict(),  # weights: null, the backbone is in the file
                      "trained_on": {"carving": None, "source": {  # the run's data, its rule
                          "class_path": "captioning.data.sources.ShapesSource",
                          "init_args": {"root": "data/shapes", "num_train": 24}}}}
    canonical = json.dumps(config["model"], sort_keys=True, separators=(",", ":"))
    assert digests == {**{name: hashlib.sha256((tiny.folder / name).read_bytes()).hexdigest()
                          for name in (WEIGHTS_FILE, VOCAB_FILE)},
                       "config.json#model": hashlib.sha256(canonical.encode()).hexdigest()}
    assert Vocabulary.load(tiny.folder / VOCAB_FILE) == tiny.vocab
    state = load_file(str(tiny.folder / WEIGHTS_FILE))
    assert state.keys() == tiny.captioner.state_dict().keys()  # no "captioner." prefix
    assert all(torch.equal(v, tiny.captioner.state_dict()[k]) for k, v in state.items())


def test_from_pretrained_decodes_identically(tiny: Tiny) -> None:
    model = Captioner.from_pretrained(tiny.folder)
    assert not model.training
    assert model.vocab == tiny.vocab and model.decode == DECODE and model.config == NET
    loaded = load_checkpoint(tiny.checkpoint)
    want = generate(loaded.captioner, tiny.images, loaded.decode)
    assert_same(generate(model, tiny.images, model.decode), want)
    texts = model.captions(tiny.images)
    assert texts == [" ".join(tiny.vocab.decode(t[:n]))
                     for t, n in zip(want.tokens.tolist(), want.lengths.tolist())]


def test_load_checkpoint_takes_a_folder(tiny: Tiny) -> None:
    loaded = load_checkpoint(tiny.folder)
    assert loaded.path == tiny.folder and loaded.vocab == tiny.vocab
    assert loaded.config == NET and loaded.decode == DECODE and not loaded.captioner.training
    assert_same(generate(loaded.captioner, tiny.images, DECODE),
                generate(tiny.captioner, tiny.images, DECODE))


def test_loading_a_folder_unpickles_nothing(tiny: Tiny, monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("unpickling while loading a model folder")

    for owner, name in ((pickle, "Unpickler"), (pickle, "load"), (pickle, "loads"),
                        (torch, "load")):
        monkeypatch.setattr(owner, name, refuse)
    model = Captioner.from_pretrained(tiny.folder)
    assert load_checkpoint(tiny.folder).vocab == model.vocab == tiny.vocab
    with pytest.raises(CheckpointError, match="unpickling"):  # the patch is live
        load_checkpoint(tiny.checkpoint)


def test_save_pretrained_round_trip_and_default_card(tiny: Tiny, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="needs the vocabulary"):
        Captioner(NET).save_pretrained(tmp_path / "x")
    with pytest.raises(ValueError, match="vocabulary has"):
        Captioner(NET).save_pretrained(tmp_path / "x", vocab=Vocabulary([*SPECIALS, "a"]))
    model = Captioner.from_pretrained(tiny.folder)
    again = model.save_pretrained(tmp_path / "again")  # its own vocabulary and decoding
    reloaded = Captioner.from_pretrained(again)
    assert reloaded.vocab == tiny.vocab and reloaded.decode == DECODE
    assert_same(generate(reloaded, tiny.images, DECODE), generate(model, tiny.images, DECODE))
    card = (again / CARD_FILE).read_text()
    assert f"captioning caption --checkpoint {again}" in card
    assert "Captioner.from_pretrained" in card and '"hidden_dim": 16' in card
    # The run's loss settings, where the folder has them, go into the copy as well.
    model.save_pretrained(tmp_path / "with", training={"doubly_stochastic": 0.25})
    copy = Captioner.from_pretrained(tmp_path / "with").save_pretrained(tmp_path / "copy")
    assert json.loads((copy / "config.json").read_text())["training"] == {
        "doubly_stochastic": 0.25}
    assert "training" not in json.loads((again / "config.json").read_text())  # none known
    # so does the record of its run's data, and `export` of a folder keeps it too
    trained_on = json.loads((tiny.folder / "config.json").read_text())["trained_on"]
    assert json.loads((again / "config.json").read_text())["trained_on"] == trained_on
    assert export("--checkpoint", again, "--out", tmp_path / "re") == 0
    assert json.loads((tmp_path / "re" / "config.json").read_text())["trained_on"] == trained_on


def test_inference_checkpoint_exports_too(tiny: Tiny, tmp_path: Path) -> None:
    ckpt = save_inference_checkpoint(tmp_path / "small.pt", tiny.captioner, tiny.vocab, DECODE)
    assert export("--checkpoint", ckpt, "--out", tmp_path / "out") == 0
    assert "Not recorded in the checkpoint" in (tmp_path / "out" / CARD_FILE).read_text()
    assert_same(generate(Captioner.from_pretrained(tmp_path / "out"), tiny.images, DECODE),
                generate(tiny.captioner, tiny.images, DECODE))


def test_vocab_json_serves_as_the_data_modules_vocab_path(tiny: Tiny) -> None:
    from captioning.data.datamodule import CaptionDataModule

    dm = CaptionDataModule(vocab_path=str(tiny.folder / VOCAB_FILE), feature_cache=False)
    assert dm.vocab == tiny.vocab


# -- the model card -------------------------------------------------------------------------------
def test_model_card(tiny: Tiny) -> None:
    card = (tiny.folder / CARD_FILE).read_text()
    assert card.startswith("# ")
    for text in ("soft attention", "`resnet18`", '"hidden_dim": 16', '"grid_size": 2',
                 '"beam_size": 2', '"max_len": 7',                     # config and decoding
                 f"captioning caption --checkpoint {tiny.folder} img.jpg",  # how to load
                 f'Captioner.from_pretrained("{tiny.folder}")', "model.vocab",
                 f"--data.vocab_path {tiny.folder}/vocab.json",
                 "`ShapesSource`", '"min_word_count": 2',                # training data
                 "step 40", "`IMAGENET1K_V1`", '"decoder_lr": 0.01',     # the run
                 "best `val/BLEU-4` of the run: 0.4321 (`best-03.ckpt`, this checkpoint)",
                 "| BLEU-4 | 0.2468 |", "| CIDEr | 1.3750 |", "test_metrics.json"):
        assert text in card, text
    assert "_instantiator" not in card


# -- the command ------------------------------------------------------------------------------------
def test_caption_command_reads_a_folder(tiny: Tiny, tmp_path: Path, write_png: Callable[..., Path],
                                        capsys: pytest.CaptureFixture[str]) -> None:
    images = [write_png(tmp_path / f"{i}.png", (40 * i, 90, 200 - 30 * i), (80, 70))
              for i in range(3)]
    capsys.readouterr()
    outputs = []
    for source in (tiny.checkpoint, tiny.folder):
        assert cli_main(["caption", "--checkpoint", str(source), *map(str, images)]) == 0
        outputs.append(capsys.readouterr().out.splitlines())
    assert outputs[0] == outputs[1] and len(outputs[1]) == 3


def test_export_refuses_a_non_empty_folder(tiny: Tiny, tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    capsys.readouterr()
    assert export("--checkpoint", tiny.checkpoint, "--out", out) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith(f"error: --out {out}: the folder is not empty") and \
        "--force" in captured.err
    assert {p.name for p in out.iterdir()} == {"notes.txt"}
    assert export("--checkpoint", tiny.checkpoint, "--out", out, "--force") == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert {p.name for p in out.iterdir()} == FILES | {"notes.txt"}  # other files are kept
    assert export("--checkpoint", out, "--out", out, "--force") == 0  # a folder, in place
    assert Captioner.from_pretrained(out).vocab == tiny.vocab
    capsys.readouterr()
    for target in (out / "notes.txt", out / "notes.txt" / "model"):  # a file, or one on the way
        assert export("--checkpoint", tiny.checkpoint, "--out", target, "--force") == 2
        assert capsys.readouterr().err == (
            f"error: --out {target}: {out / 'notes.txt'} is a file, not a folder\n")


def test_export_user_errors(tiny: Tiny, tmp_path: Path,
                            capsys: pytest.CaptureFixture[str]) -> None:
    cases = [(["--checkpoint", tmp_path / "none.ckpt", "--out", tmp_path / "a"], "does not exist"),
             (["--checkpoint", tiny.checkpoint, "--out", tiny.checkpoint],
              "is a file, not a folder"),
             (["--checkpoint", tmp_path, "--out", tmp_path / "b"], "nor an exported model")]
    for args, message in cases:
        capsys.readouterr()
        assert export(*args) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    assert export("--checkpoint", tiny.checkpoint) == 2  # argparse: --out is required
    assert export("--help") == 0


def test_export_help_does_not_import_torch() -> None:
    code = ("import sys\nfrom captioning.commands.export import main\n"
            "assert main(['--help']) == 0\nassert 'torch' not in sys.modules, 'torch'\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr


# -- interrupted writes -------------------------------------------------------------------------
def test_an_interrupted_write_leaves_no_complete_looking_folder(
        tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "model"
    shutil.copytree(tiny.folder, out)
    write_bytes = Path.write_bytes

    def crash(self: Path, data: bytes) -> int:  # the weights' temporary: half, then a full disk
        if WEIGHTS_FILE not in self.name:
            return write_bytes(self, data)
        write_bytes(self, b"half a file")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_bytes", crash)
    with pytest.raises(OSError, match="No space"):
        tiny.captioner.save_pretrained(out, vocab=tiny.vocab)
    assert not is_pretrained_dir(out)  # config.json went first
    assert {p.name for p in out.iterdir()} == FILES - {CONFIG_FILE}  # temporary file removed
    with pytest.raises(CheckpointError, match=f"{out / CONFIG_FILE}: missing"):
        load_checkpoint(out)


# -- broken folders -----------------------------------------------------------------------------
def _weights(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        state = load_file(str(folder / WEIGHTS_FILE))
        edit(state)
        (folder / WEIGHTS_FILE).unlink()  # a hard link to the shared file
        save_file(state, str(folder / WEIGHTS_FILE))
    return apply


def _json(name: str, edit: Callable[[dict[str, Any]], Any]) -> Callable[[Path], None]:
    def apply(folder: Path) -> None:
        data = json.loads((folder / name).read_text())
        edit(data)
        (folder / name).write_text(json.dumps(data))
    return apply


def _truncate(folder: Path) -> None:
    data = (folder / WEIGHTS_FILE).read_bytes()
    (folder / WEIGHTS_FILE).unlink()  # a hard link to the shared file
    (folder / WEIGHTS_FILE).write_bytes(data[: len(data) // 2])


def _flip(folder: Path) -> None:
    """4 KiB of the tensors' bytes overwritten: still a readable safetensors file."""
    data = bytearray((folder / WEIGHTS_FILE).read_bytes())
    (folder / WEIGHTS_FILE).unlink()
    data[len(data) // 2: len(data) // 2 + 4096] = os.urandom(4096)
    (folder / WEIGHTS_FILE).write_bytes(bytes(data))


def _garbage(folder: Path) -> None:
    (folder / WEIGHTS_FILE).unlink()
    (folder / WEIGHTS_FILE).write_bytes(os.urandom(256))


BROKEN: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "no config": (CONFIG_FILE, lambda f: (f / CONFIG_FILE).unlink(), "missing"),
    "no vocab": (VOCAB_FILE, lambda f: (f / VOCAB_FILE).unlink(), "missing"),
    "no weights": (WEIGHTS_FILE, lambda f: (f / WEIGHTS_FILE).unlink(), "missing"),
    "config not JSON": (CONFIG_FILE, lambda f: (f / CONFIG_FILE).write_text("{'model': 1"),
                        "not valid JSON"),
    "vocab not JSON": (VOCAB_FILE, lambda f: (f / VOCAB_FILE).write_text("words: [a]"),
                       "not valid JSON"),
    "wrong format": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d.update(format="other")),
                     "not a captioning model folder config"),
    "newer format": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d.update(format_version=2)),
                     "newer than this version"),
    "bad model config": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d["model"].update(x=1)),
                         "invalid model config"),
    "bad decoding": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d["decode"].update(beam_size=0)),
                     "invalid decoding settings"),
    "truncated weights": (WEIGHTS_FILE, _truncate, "not a readable safetensors file"),
    "not safetensors": (WEIGHTS_FILE, _garbage, "not a readable safetensors file"),
    "missing weight": (WEIGHTS_FILE, _weights(lambda s: s.pop("decoder.gate.weight")),
                       "1 missing: decoder.gate.weight"),
    "unexpected weight": (WEIGHTS_FILE, _weights(lambda s: s.update(extra=torch.zeros(2))),
                          "1 unexpected: extra"),
    "wrong shape": (WEIGHTS_FILE, _weights(lambda s: s.update(
        {"decoder.gate.weight": torch.zeros(3, 3)})), "1 of another shape"),
    "vocab too big": (VOCAB_FILE, _json(VOCAB_FILE, lambda d: d["words"].append("zebra")),
                      "vocabulary size mismatch (vocabulary 15, model config vocab_size 14, "
                      "embedding rows 14)"),
    "vocab invalid": (VOCAB_FILE, _json(VOCAB_FILE, lambda d: d.update(words=["a"])),
                      "vocabulary must start with the specials"),
    # Damage a reader cannot see gave wrong captions: config.json's digests catch it.
    "damaged weights": (WEIGHTS_FILE, _flip, "its SHA-256 is not the one config.json records"),
    "words swapped": (VOCAB_FILE, _json(VOCAB_FILE, lambda d: d.update(
        words=[*d["words"][:4], d["words"][5], d["words"][4], *d["words"][6:]])),
                      "its SHA-256 is not the one config.json records"),
    "bad digests": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d.update(sha256=[])),
                    "'sha256' must be an object, got list"),
    "model settings edited": (CONFIG_FILE, _json(CONFIG_FILE, lambda d: d["model"].update(
        grid_size=3, image_size=96)), "its 'model' settings are not the ones the weights were "
        "exported with (edited since; only 'decode' may change)"),
}
#: Cases of a folder whose config.json records no digests (older exports): each file's own
#: checks find what is wrong with it.
NO_DIGESTS = {"missing weight", "unexpected weight", "wrong shape", "vocab too big",
              "vocab invalid", "vocab not JSON", "bad model config"}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_a_broken_folder_fails_in_one_line_naming_the_file(tiny: Tiny, tmp_path: Path,
                                                           case: str) -> None:
    name, breakage, message = BROKEN[case]
    folder = tmp_path / "model"
    folder.mkdir()
    for f in tiny.folder.iterdir():  # the 45 MB of weights are hard-linked, not copied
        (os.link if f.name == WEIGHTS_FILE else shutil.copy)(f, folder / f.name)
    if case in NO_DIGESTS:
        _json(CONFIG_FILE, lambda d: d.pop("sha256"))(folder)
    breakage(folder)
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(folder)
    text = str(info.value)
    assert "\n" not in text and text.startswith(f"{folder / name}: ") and message in text, text
    with pytest.raises(PretrainedError, match="^" + str(folder / name)):
        Captioner.from_pretrained(folder)
    assert (tiny.folder / WEIGHTS_FILE).stat().st_size > 1e6  # the shared file is intact


def test_not_a_folder_or_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="is not a file, nor an exported model folder"):
        load_checkpoint(tmp_path)
    with pytest.raises(PretrainedError, match="does not exist"):
        Captioner.from_pretrained(tmp_path / "none")
    (tmp_path / "f.txt").write_text("x")
    with pytest.raises(PretrainedError, match=r"a checkpoint file loads with "
                                              r"captioning\.checkpoint\.load_checkpoint"):
        Captioner.from_pretrained(tmp_path / "f.txt")
    with pytest.raises(FileExistsError, match="not a folder"):
        write_model_folder(tmp_path / "f.txt", state={}, model={}, decode={},
                           vocab=Vocabulary(SPECIALS), card="")


# -- a real Lightning checkpoint ----------------------------------------------------------------


def test_a_trained_checkpoint_exports_and_captions_alike(trained: Trained, tmp_path: Path,
                                                        capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    out = tmp_path / "trained"
    assert export("--checkpoint", trained.checkpoint, "--out", out) == 0
    model = Captioner.from_pretrained(out)
    assert model.vocab == trained.vocab and model.decode == trained.module.decode
    assert model.captions(trained.batch(trained.images)) == trained.captions(trained.images)
    card = (out / CARD_FILE).read_text()
    assert "`ShapesSource`" in card and "step 40" in card
    capsys.readouterr()
    paths = [str(p) for p in trained.images[:4]]
    assert cli_main(["caption", "--checkpoint", str(out), "--beam-size", "2", *paths]) == 0
    got = [ln.split("\t")[1] for ln in capsys.readouterr().out.splitlines()]
    assert got == trained.captions(trained.images[:4], DecodeConfig(beam_size=2, max_len=12))


@needs_java
def test_lightning_test_takes_an_exported_folder(shapes_dm_kwargs: dict[str, Any],
                                                 cache_dir: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """`captioning test --ckpt_path DIR` scores exactly as `--ckpt_path CKPT` does, the loss
    too (the folder keeps the run's loss settings); `fit` refuses a folder (it holds no
    training state) in one line."""
    import csv

    import yaml
    from tiny_runs import cli_config, error_lines

    ckpt_dir = tmp_path / "ckpt"
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir)
    data = yaml.safe_load(cfg.read_text())
    data["model"]["doubly_stochastic"] = 0.25  # not the default: the test loss depends on it
    trained_with = tmp_path / "fit.yaml"  # the tests below run with the default's config
    trained_with.write_text(yaml.safe_dump(data))
    assert cli_main(["fit", "--config", str(trained_with)]) == 0
    folder = tmp_path / "m"
    assert export("--checkpoint", str(ckpt_dir / "last.ckpt"), "--out", str(folder)) == 0
    assert json.loads((folder / "config.json").read_text())["training"]["doubly_stochastic"] \
        == 0.25
    captions, metrics, losses = {}, {}, {}
    for name, path in (("ckpt", ckpt_dir / "last.ckpt"), ("dir", folder)):
        out = tmp_path / f"results-{name}"
        logger = json.dumps({"class_path": "lightning.pytorch.loggers.CSVLogger",
                             "init_args": {"save_dir": str(out), "name": "csv"}})
        assert cli_main(["test", "--config", str(cfg), "--ckpt_path", str(path),
                         "--model.compute_metrics", "true", "--model.results_dir", str(out),
                         "--trainer.logger", logger]) == 0
        captions[name] = json.loads((out / "test_captions.json").read_text())
        metrics[name] = json.loads((out / "test_metrics.json").read_text())
        [rows] = [list(csv.DictReader(f.open())) for f in out.glob("csv/*/metrics.csv")]
        losses[name] = next(float(r["test/loss"]) for r in rows if r.get("test/loss"))
    assert captions["dir"] == captions["ckpt"] and captions["dir"]
    assert metrics["dir"] == metrics["ckpt"] and "CIDEr" in metrics["dir"]  # to the last digit
    assert losses["dir"] == losses["ckpt"]
    before = {p.name: p.read_bytes() for p in ckpt_dir.iterdir()}
    capsys.readouterr()
    assert cli_main(["fit", "--config", str(cfg), "--ckpt_path", str(folder)]) == 2
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert line.startswith(f"error: --ckpt_path {folder}: an exported model folder has no "
                           "training state to resume"), line
    assert "Traceback" not in err  # and nothing trained or written
    assert {p.name: p.read_bytes() for p in ckpt_dir.iterdir()} == before


def test_export_writes_only_its_own_temporaries_and_clears_stale_ones(
        tiny: Tiny, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import safetensors.torch

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("save_file leaves a .tmpXXXX of its own when killed")

    monkeypatch.setattr(safetensors.torch, "save_file", refuse)
    out = tmp_path / "model"
    out.mkdir()
    stale = out / f".{WEIGHTS_FILE}.999999999.0123abcd.tmp"  # of a killed export
    stale.write_bytes(b"x" * 10)
    Captioner.from_pretrained(tiny.folder).save_pretrained(out)
    assert not stale.exists() and not [p for p in out.iterdir() if "tmp" in p.name]
    assert_same(generate(Captioner.from_pretrained(out), tiny.images, DECODE),
                generate(Captioner.from_pretrained(tiny.folder), tiny.images, DECODE))


def test_the_readmes_python_example_runs(tiny: Tiny, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The README's Python example under "Sharing a trained model", run as written on an
    exported folder and a photo: captions, words aligned with α's steps, maps on the grid;
    `model_inputs` takes a file or a PIL image alike, as `caption` loads them."""
    import re

    from PIL import Image

    from captioning.data.transforms import model_inputs

    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    section = readme.split("## Sharing a trained model", 1)[1].split("\n## ", 1)[0]
    (code,) = [c for c in re.findall(r"```python\n(.*?)```", section, re.S)
               if "model_inputs" in c]
    monkeypatch.chdir(tmp_path)
    shutil.copytree(tiny.folder, "demo-soft-model")
    photo = Image.new("RGB", (90, 70), (200, 40, 40))
    photo.paste((20, 20, 220), (10, 10, 50, 40))
    photo.save("photo.jpg", quality=95)
    scope: dict[str, Any] = {}
    exec(compile(code, "README.md", "exec"), scope)  # the README's own example
    model, gen, words = scope["model"], scope["gen"], scope["words"]
    assert scope["captions"] == [" ".join(w for w in words[0] if w not in SPECIALS)]
    assert len(words[0]) == int(gen.lengths[0]) - int(gen.finished[0])  # <end>: a step, no word
    assert scope["maps"].shape == (1, gen.alphas.shape[1], *model.grid)
    assert torch.allclose(scope["maps"].sum((-2, -1))[0, : len(words[0])], torch.ones(1))
    again = Captioner.from_pretrained("copy-of-model")
    with torch.inference_mode():
        assert again.captions(scope["images"]) == scope["captions"]
    with Image.open("photo.jpg") as im:  # a PIL image: the same input as its file
        assert torch.equal(model_inputs([im], model.config.image_size), scope["images"])
    with pytest.raises(TypeError, match=r"got JpegImageFile: for image files or PIL images, "
                                        r"pass captioning\.data\.transforms\.model_inputs"):
        model.captions(Image.open("photo.jpg"))


def test_captions_in_training_mode_warn(tiny: Tiny) -> None:
    """Dropout makes a training-mode model's captions change at every call: `captions()` says
    so (a model from `from_pretrained` is in eval mode)."""
    import warnings

    assert not Captioner.from_pretrained(tiny.folder).training
    model = Captioner(replace(NET, dropout=0.5)).eval()
    model.vocab = tiny.vocab
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.captions(tiny.images)  # eval mode: no warning
    with pytest.warns(UserWarning, match=r"training mode: dropout \(and a trainable encoder's "
                                         r"batch norm\) change every call's captions; call "
                                         r"model\.eval\(\) first"):
        model.train().captions(tiny.images)
