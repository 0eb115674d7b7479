"""Checkpoints written before the redesign still work (tests/data/main_v1/README.md).

The file has the old flat decoding hyperparameters and the old top-level REINFORCE baseline
buffers; `captioning caption` and `captioning test` must give what they gave at that commit.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from captioning.checkpoint import STATE_KEY_MAP, load_checkpoint, upgrade, upgrade_hparams
from captioning.cli import main
from captioning.data.shapes import generate_shapes
from captioning.models.captioner import DecodeConfig
from captioning.models.pretrained import MODEL_DIGEST

OLD = Path(__file__).resolve().parent / "data" / "main_v1"
CKPT = OLD / "hard_token.ckpt"


def test_upgrade_maps_old_keys() -> None:
    hp = upgrade_hparams({"eval_strategy": "greedy", "beam_size": 5, "max_len": 9,
                          "decoder_lr": 0.1})
    assert hp == {"decoder_lr": 0.1, "decode": {"strategy": "greedy", "beam_size": 5,
                                                "max_len": 9}}
    assert upgrade_hparams(hp) == hp  # today's layout is left alone
    state = {"baseline.value": torch.zeros(()), "token_baseline.seen": torch.zeros(3),
             "captioner.w": torch.ones(1)}
    soft = upgrade({"state_dict": dict(state)}, own_keys={"captioner.w"})
    assert set(soft["state_dict"]) == {"captioner.w"}  # a soft model has no baseline
    hard = upgrade({"state_dict": dict(state)})
    assert set(hard["state_dict"]) == {"objective.baseline.value",
                                       "objective.token_baseline.seen", "captioner.w"}
    assert set(STATE_KEY_MAP.values()) <= {"objective.baseline.", "objective.token_baseline."}


def test_old_checkpoint_loads_with_its_decoding_settings() -> None:
    model = load_checkpoint(CKPT)
    assert model.decode == DecodeConfig(strategy="beam", beam_size=2, max_len=12)
    assert model.config.attention == "hard"


def test_caption_gives_the_old_captions(tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    images = shutil.copytree(OLD / "images", tmp_path / "images")
    assert main(["caption", "--checkpoint", str(CKPT), "--json", str(images)]) == 0
    got = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    want = [json.loads(line) for line in (OLD / "captions.jsonl").read_text().splitlines()]
    assert [Path(g["path"]).name for g in got] == [Path(w["path"]).name for w in want]
    assert [g["caption"] for g in got] == [w["caption"] for w in want]
    assert [g["score"] for g in got] == pytest.approx([w["score"] for w in want], abs=1e-4)


def test_test_command_gives_the_old_metrics(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                           caplog: pytest.LogCaptureFixture) -> None:
    root = generate_shapes(tmp_path / "shapes", num_train=16, num_val=4, num_test=4,
                           image_size=64, seed=0)
    trainer = tmp_path / "trainer.yaml"
    trainer.write_text("seed_everything: 0\ntrainer:\n  accelerator: cpu\n  devices: 1\n"
                       "  logger: false\n  enable_progress_bar: false\n"
                       "  enable_model_summary: false\n"
                       f"  default_root_dir: {tmp_path / 'run'}\n")
    model = tmp_path / "model.yaml"  # the run's config in today's layout
    old = yaml.safe_load((OLD / "model.yaml").read_text())
    model.write_text(yaml.safe_dump({"model": upgrade_hparams(old["model"])}))
    source = ["--data.source", "ShapesSource", "--data.source.root", str(root),
              "--data.source.num_train", "16", "--data.source.num_val", "4",
              "--data.source.num_test", "4", "--data.source.image_size", "64"]
    status = main(["test", "--config", str(trainer), "--config", str(model),
                   *source, "--data.image_size", "64", "--data.batch_size", "8",
                   "--data.eval_batch_size", "4", "--data.cache_dir", str(tmp_path / "features"),
                   "--ckpt_path", str(CKPT), "--model.results_dir", str(tmp_path / "results")])
    assert status == 0
    got = json.loads((tmp_path / "results" / "test_metrics.json").read_text())
    want = json.loads((OLD / "test_metrics.json").read_text())
    want.pop("test/nll_per_word")
    assert got.pop("images") == 4  # scored images: a count added since
    assert got == pytest.approx(want, abs=1e-6)
    # A setting the checkpoint predates is the value it was trained with: a flag changing the
    # network (the same weights, another function) is refused, not evaluated silently.
    for flag, value, theirs in (("output_tanh", "true", "False"),
                                ("normalizer", "sparsemax", "'softmax'")):
        assert main(["test", "--config", str(trainer), "--config", str(model), *source,
                     "--data.image_size", "64", "--ckpt_path", str(CKPT),
                     f"--model.net.{flag}", value]) == 2
        assert f"(the checkpoint has {theirs})" in capsys.readouterr().err
    assert upgrade_hparams(old["model"])["net"]["output_tanh"] is False
    assert "weight_init" not in old["model"]["net"]  # written before these fields existed
    # An exported folder written before them (no such fields, no settings digest) likewise.
    folder = tmp_path / "exported"
    assert main(["export", "--checkpoint", str(CKPT), "--out", str(folder)]) == 0
    config = json.loads((folder / "config.json").read_text())
    for name in ("normalizer", "output_tanh", "weight_init"):
        del config["model"][name]
    config.get("sha256", {}).pop(MODEL_DIGEST, None)
    (folder / "config.json").write_text(json.dumps(config))
    assert main(["test", "--config", str(trainer), "--config", str(model), *source,
                 "--data.image_size", "64", "--ckpt_path", str(folder),
                 "--model.net.output_tanh", "true"]) == 2
    assert "(the checkpoint has False)" in capsys.readouterr().err
    # a setting that only decides how weights start is no conflict: every weight is loaded
    assert main(["test", "--config", str(trainer), "--config", str(model), *source,
                 "--data.image_size", "64", "--data.batch_size", "8",
                 "--data.eval_batch_size", "4", "--data.cache_dir", str(tmp_path / "features"),
                 "--ckpt_path", str(folder), "--model.net.weight_init", "capgen",
                 "--model.results_dir", str(tmp_path / "folder_results")]) == 0
    got = json.loads((tmp_path / "folder_results" / "test_metrics.json").read_text())
    got.pop("images")
    assert got == pytest.approx(want, abs=1e-6)
    # It records no data source (no trained_on), but the shapes splits are the source's own,
    # not carved: nothing to warn about
    assert "trained_on" not in config
    assert not [r for r in caplog.records if "records no data source" in r.getMessage()]
