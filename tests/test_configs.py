"""The real YAML configs: every combination parses, and the demo config, shrunk, trains."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from conftest import needs_java, paper_shrink_args, shapes_cli_args, write_tiny_coco
from tiny_runs import print_config

from captioning.cli import main
from captioning.commands.configs import CONFIG_DIR

TRAINERS = sorted((CONFIG_DIR / "trainer").glob("*.yaml"))
DATA = sorted((CONFIG_DIR / "data").glob("*.yaml"))
MODELS = sorted((CONFIG_DIR / "model").glob("*.yaml"))


def _print_config(*configs: Path, extra: list[str] | None = None) -> dict[str, Any]:
    return print_config("fit", *[a for c in configs for a in ("--config", str(c))], *(extra or []))


def test_config_folders_are_populated() -> None:
    names = {p.stem for p in MODELS}
    assert {"demo_soft", "demo_hard", "paper_soft", "paper_hard"} <= names
    assert {"shapes", "coco", "flickr8k", "flickr30k", "coco_raw"} <= {p.stem for p in DATA}
    assert {"cpu", "gpu"} <= {p.stem for p in TRAINERS}


def _combinations() -> list[tuple[Path, Path, Path]]:
    """Every config file at least once: each model on shapes, each dataset with each attention."""
    cpu, shapes = CONFIG_DIR / "trainer" / "cpu.yaml", CONFIG_DIR / "data" / "shapes.yaml"
    combos = {(t, shapes, CONFIG_DIR / "model" / "demo_soft.yaml") for t in TRAINERS}
    combos |= {(cpu, shapes, m) for m in MODELS}
    combos |= {(cpu, d, CONFIG_DIR / "model" / f"paper_{a}.yaml")
               for d, a in itertools.product(DATA, ("soft", "hard")) if d != shapes}
    return sorted(combos)


@pytest.mark.parametrize(("trainer", "data", "model"), _combinations(), ids=lambda p: p.stem)
def test_every_combination_parses(trainer: Path, data: Path, model: Path) -> None:
    cfg = _print_config(trainer, data, model)
    mine = yaml.safe_load(model.read_text())["model"]["net"]
    assert cfg["model"]["net"]["attention"] == mine["attention"]
    assert cfg["model"]["net"]["backbone"] == mine["backbone"]
    source = yaml.safe_load(data.read_text())["data"]["source"]
    assert cfg["data"]["source"]["class_path"] == source["class_path"]


def test_paper_configs_follow_the_paper() -> None:
    for name in ("paper_soft", "paper_hard"):
        net = yaml.safe_load((CONFIG_DIR / "model" / f"{name}.yaml").read_text())["model"]["net"]
        assert net["backbone"] == "vgg19" and net["grid_size"] == 14  # conv5_4, 14x14x512
        assert net["attention"] == name.split("_")[1]


def test_data_paths_are_overridable(tmp_path: Path) -> None:
    split_file = tmp_path / "dataset_coco.json"
    cfg = _print_config(TRAINERS[0], CONFIG_DIR / "data" / "coco.yaml", MODELS[0],
                        extra=["--data.source.split_file", str(split_file),
                               "--data.source.image_root", str(tmp_path)])
    assert cfg["data"]["source"]["init_args"]["split_file"] == str(split_file)
    assert cfg["data"]["source"]["init_args"]["image_root"] == str(tmp_path)


@needs_java
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_demo_config_shrunk_fits(attention: str, shapes_root: Path, tmp_path: Path,
                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`captioning fit` with the real demo configs, shrunk to a few steps on tiny data."""
    from captioning.commands.lightning import wandb_dirs

    monkeypatch.setenv("WANDB_MODE", "offline")
    for k, v in wandb_dirs(tmp_path).items():
        monkeypatch.setenv(k, v)
    trainer_cfg = yaml.safe_load((CONFIG_DIR / "trainer" / "cpu.yaml").read_text())
    trainer_cfg["trainer"]["default_root_dir"] = str(tmp_path)
    for lg in trainer_cfg["trainer"]["logger"]:
        lg["init_args"]["save_dir"] = str(tmp_path)
    for cb in trainer_cfg["trainer"]["callbacks"]:
        if cb["class_path"].endswith("ModelCheckpoint"):
            cb["init_args"]["dirpath"] = str(tmp_path / "checkpoints")
    (tmp_path / "trainer.yaml").write_text(yaml.safe_dump(trainer_cfg))
    main(["fit", "--config", str(tmp_path / "trainer.yaml"),
          "--config", str(CONFIG_DIR / "data" / "shapes.yaml"),
          "--config", str(CONFIG_DIR / "model" / f"demo_{attention}.yaml"),
          *shapes_cli_args(shapes_root),
          "--data.batch_size", "8", "--data.eval_batch_size", "8",
          "--data.cache_dir", str(tmp_path / "features"),
          "--model.net.weights", "null", "--model.decode.max_len", "8",
          "--trainer.max_epochs", "1", "--trainer.limit_train_batches", "3",
          "--trainer.check_val_every_n_epoch", "1", "--trainer.log_every_n_steps", "1",
          "--trainer.enable_progress_bar", "false"])
    ckpts = sorted((tmp_path).rglob("*.ckpt"))
    assert any(p.name == "last.ckpt" for p in ckpts)
    ckpt = torch.load(next(p for p in ckpts if p.name == "last.ckpt"), weights_only=True)
    assert ckpt["global_step"] == 3
    assert ckpt["captioning_model_config"]["attention"] == attention
    assert len(ckpt["captioning_vocab"]["words"]) > 4
    csv = next(tmp_path.rglob("metrics.csv")).read_text()
    assert "val/BLEU-4" in csv and "train/loss" in csv
    assert "train/attn_entropy" in csv and "val/attn_entropy" in csv  # soft and hard alike
    assert list(tmp_path.rglob("offline-run-*")), "the W&B offline run is inside the run folder"
    if attention == "hard":
        assert "train/advantage" in csv and "train/attn_entropy" in csv
    json.dumps(ckpt["hyper_parameters"])  # plain data only


@needs_java
@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_readme_paper_command_shrunk_trains_and_tests(
        attention: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """README's COCO command, `captioning fit --config trainer/gpu --config data/coco --config
    paper_<attention>` with the split file and image folder given, on a tiny dataset in the
    dataset_coco.json layout; then `captioning test` of its checkpoint. Shrunk to run here
    (`paper_shrink_args`)."""
    from captioning.commands.lightning import wandb_dirs

    monkeypatch.chdir(tmp_path)  # the config's runs/paper is relative, as for a user
    monkeypatch.setenv("WANDB_MODE", "offline")
    for k, v in wandb_dirs(tmp_path).items():
        monkeypatch.setenv(k, v)
    shown = "captioning fit --config trainer/gpu --config data/coco --config paper_soft"
    assert shown in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    split_file = write_tiny_coco(tmp_path / "coco")
    readme = ["--config", "trainer/gpu", "--config", "data/coco",
              "--config", f"paper_{attention}",
              "--data.source.split_file", str(split_file),
              "--data.source.image_root", str(tmp_path / "coco")]
    main(["fit", *readme, *paper_shrink_args(tmp_path)])
    ckpt_path = tmp_path / "runs" / "paper" / "checkpoints" / "last.ckpt"
    ckpt = torch.load(ckpt_path, weights_only=True)
    assert ckpt["global_step"] == 2
    net = ckpt["captioning_model_config"]
    assert (net["backbone"], net["hidden_dim"], net["attention"]) == ("vgg19", 1800, attention)
    main(["test", *readme, *paper_shrink_args(tmp_path), "--ckpt_path", str(ckpt_path)])
    metrics = json.loads((tmp_path / "runs" / "paper" / "test_metrics.json").read_text())
    assert "BLEU-4" in json.dumps(metrics)
    # The README's `captioning score` of the test pass's captions gives the test's scores.
    shown = ("captioning score runs/paper/test_captions.json --references "
             "data/coco/dataset_coco.json --split test --eval-references 5")  # data/coco's 5
    assert shown in (Path(__file__).resolve().parent.parent / "README.md").read_text()
    assert main(["score", "runs/paper/test_captions.json", "--references", str(split_file),
                 "--split", "test", "--eval-references", "5",
                 "--out", str(tmp_path / "scores.json")]) == 0
    scored = json.loads((tmp_path / "scores.json").read_text())
    assert set(scored) == {"BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr"}
    assert scored == pytest.approx({k: metrics[k] for k in scored}, abs=1e-12)


class _Parsed(Exception):
    """Raised in place of building the classes: the parsed config is in `args[0]`."""


@pytest.mark.parametrize("trainer", ["cpu", "gpu", "gpu_ddp"])
def test_default_root_dir_on_the_command_line_moves_the_whole_run(
        trainer: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--trainer.default_root_dir DIR` moves the loggers' folders and the best checkpoints'
    folder that the trainer config put in its own run folder (they stayed there: two runs
    with different DIRs mixed their best checkpoints and logs); a folder the user put
    elsewhere stays; without the flag nothing moves."""
    from captioning.commands.lightning import CaptioningCLI, lightning_cli

    def parsed(self: CaptioningCLI) -> None:
        raise _Parsed(self.config[self.subcommand]["trainer"])

    monkeypatch.setattr(CaptioningCLI, "before_instantiate_classes", parsed)
    shipped = yaml.safe_load((CONFIG_DIR / "trainer" / f"{trainer}.yaml").read_text())
    old = shipped["trainer"]["default_root_dir"]

    def outputs(*extra: str) -> tuple[str, list[str]]:
        with pytest.raises(_Parsed) as e:
            lightning_cli(["fit", "--config", f"trainer/{trainer}", "--config", "data/shapes",
                           "--config", "model/demo_soft", *extra])
        t = e.value.args[0]
        loggers = t["logger"] if isinstance(t["logger"], list) else [t["logger"]]
        return t["default_root_dir"], [lg["init_args"]["save_dir"] for lg in loggers] + [
            cb["init_args"]["dirpath"] for cb in t["callbacks"]
            if cb["class_path"].endswith(".ModelCheckpoint")]

    root, folders = outputs()
    assert root == old and folders and all(f.startswith(old) for f in folders)
    new = str(tmp_path / "run")
    root, moved = outputs("--trainer.default_root_dir", new)
    assert root == new
    assert moved == [f.replace(old, new, 1) for f in folders]
    assert str(Path(new) / "checkpoints") in moved
    mine = str(tmp_path / "elsewhere")  # a folder outside the config's run folder stays
    _, kept = outputs("--trainer.default_root_dir", new,
                      "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                      f"--trainer.callbacks.dirpath={mine}")
    assert kept == [*moved, mine]
    # The trainer config given as a group file (`--trainer FILE`, its keys without "trainer.").
    group = tmp_path / "trainer.yaml"
    group.write_text(yaml.safe_dump(shipped["trainer"]))
    with pytest.raises(_Parsed) as e:
        lightning_cli(["fit", "--trainer", str(group), "--config", "data/shapes", "--config",
                       "model/demo_soft", "--trainer.default_root_dir", new])
    t = e.value.args[0]
    assert [cb["init_args"]["dirpath"] for cb in t["callbacks"]
            if cb["class_path"].endswith(".ModelCheckpoint")] == [str(Path(new) / "checkpoints")]


def test_output_folders_of_a_trainer_config() -> None:
    """The loggers' `save_dir` and every checkpoint callback's `dirpath`, subclasses and the
    short class names LightningCLI accepts (`ModelCheckpoint`) included."""
    from captioning.commands.configs import output_folders

    trainer = {"logger": [{"class_path": "CSVLogger", "init_args": {"save_dir": "x"}}],
               "callbacks": [{"class_path": "ModelCheckpoint"},
                             {"class_path": "LearningRateMonitor"},
                             {"class_path": "captioning.callbacks.LatestCheckpoint"},
                             {"class_path": "no.such.Callback"}]}
    assert [(e["class_path"], key) for e, key in output_folders(trainer)] == [
        ("CSVLogger", "save_dir"), ("ModelCheckpoint", "dirpath"),
        ("captioning.callbacks.LatestCheckpoint", "dirpath")]
