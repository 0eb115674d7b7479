"""AttentionOverlayCallback: W&B offline logging, PNG fallback, rank zero only, cadence."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from conftest import needs_java
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.utilities import rank_zero_only
from PIL import Image

from captioning.callbacks import AttentionOverlayCallback
from captioning.commands.lightning import wandb_dirs
from captioning.data.datamodule import CaptionDataModule
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import CaptionerConfig, DecodeConfig

S = 64  # image size: every panel is S wide
LABEL = 14  # render_strips' default label strip height


def make_dm(kwargs: dict[str, Any], tmp_path: Path, *, feature_cache: bool) -> CaptionDataModule:
    return CaptionDataModule(**{**kwargs, "batch_size": 8, "feature_cache": feature_cache,
                                "cache_dir": str(tmp_path / "features")})


def make_module(dm: CaptionDataModule, attention: str = "soft") -> CaptioningModule:
    net = CaptionerConfig(backbone="resnet18", weights=None, grid_size=4, image_size=S,
                          embed_dim=16, hidden_dim=32, attn_dim=16, attention=attention)
    return CaptioningModule(vocab_size=dm.vocab_size, net=net, compute_metrics=False,
                            decode=DecodeConfig(strategy="greedy", max_len=8))


def expected_widths(cb: AttentionOverlayCallback) -> list[int]:
    return sorted((len(w) + 1) * S for w in cb.last_words.values())


def check_strip(path: Path) -> np.ndarray:
    """Open a strip PNG and check that it is a real picture (not black): the image panel and
    every word's panel are mostly non-zero (viridis has no black); panels past a shorter
    caption's words, padding to the batch's longest, are all zero."""
    a = np.asarray(Image.open(path).convert("RGB"))
    assert a.shape[0] == S + LABEL and a.shape[1] % S == 0
    lit = [(a[:S, k: k + S].max(-1) > 0).mean() for k in range(0, a.shape[1], S)]
    assert lit[0] > 0.5, lit  # the image
    words = next((i for i, x in enumerate(lit) if x == 0), len(lit))
    assert all(x > 0.5 for x in lit[:words]) and not any(lit[words:]), lit
    return a


@pytest.mark.parametrize(("feature_cache", "attention"), [(True, "soft"), (False, "hard")])
def test_offline_wandb_run_gets_strips_and_table(shapes_dm_kwargs: dict, tmp_path: Path,
                                                 tiny_fit: Any,
                                                 monkeypatch: pytest.MonkeyPatch,
                                                 feature_cache: bool, attention: str) -> None:
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    for k, v in wandb_dirs(tmp_path).items():
        Path(v).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(k, v)
    dm = make_dm(shapes_dm_kwargs, tmp_path, feature_cache=feature_cache)
    module = make_module(dm, attention)
    cb = AttentionOverlayCallback(num_images=2)
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="test")
    try:
        tiny_fit(dm, module, tmp_path, callbacks=[cb], logger=logger, sanity_steps=1)
    finally:
        wandb.finish()

    assert cb.validation_epochs == 1  # the sanity check is not counted
    ids = [r.image_id for r in dm.records("val")[:2]]
    assert list(cb.last_words) == ids  # the first records, in order
    assert not cb.last_paths  # W&B present, no save_dir: no PNG files of our own

    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    media = runs[0] / "files" / "media"
    pngs = sorted((media / "images").rglob("*.png"))
    strips = [p for p in pngs if "attention_table" not in str(p.relative_to(media))]
    assert len(strips) == 2
    # One size for the media list (W&B shows lists of mixed sizes wrongly); panels past a
    # caption's end are black. The table's overlay cells are cut to their own captions.
    assert [check_strip(p).shape[1] for p in strips] == [max(expected_widths(cb))] * 2
    tables = list((media / "table").rglob("*.json"))
    assert len(tables) == 1
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["image", "caption", "references", "overlay"]
    assert len(table["data"]) == 2
    assert sorted(row[1] for row in table["data"]) == sorted(cb.last_captions.values())
    # The table's image cells travel in a run-table artifact, staged inside WANDB_DATA_DIR.
    staged = [p for p in (tmp_path / "wandb-data").rglob("*")
              if p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"]
    sizes = sorted(Image.open(p).size for p in staged)
    assert sizes == sorted([(S, S)] * 2 + [(w, S + LABEL) for w in expected_widths(cb)])
    assert all(np.asarray(Image.open(p)).max() > 0 for p in staged)


def test_without_wandb_pngs_go_to_the_log_dir(shapes_dm_kwargs: dict, tmp_path: Path,
                                              tiny_fit: Any) -> None:
    dm = make_dm(shapes_dm_kwargs, tmp_path, feature_cache=True)
    cb = AttentionOverlayCallback(num_images=2, upsample="gaussian")
    trainer = tiny_fit(dm, make_module(dm), tmp_path, callbacks=[cb],
                       logger=CSVLogger(str(tmp_path), name="csv"), sanity_steps=1)
    folder = Path(trainer.log_dir) / "overlays" / "epoch_00"
    pngs = sorted(folder.glob("*.png"))
    assert pngs == sorted(cb.last_paths) and len(pngs) == 2
    assert sorted(check_strip(p).shape[1] for p in pngs) == expected_widths(cb)


def stub_trainer(dm: Any = None, **kw: Any) -> SimpleNamespace:
    base = dict(sanity_checking=False, is_global_zero=True, datamodule=dm, loggers=[],
                current_epoch=3, global_step=7, log_dir=None, default_root_dir=".")
    return SimpleNamespace(**{**base, **kw})


def test_save_dir_restores_training_mode_and_caps_words(shapes_dm_kwargs: dict,
                                                        tmp_path: Path) -> None:
    dm = make_dm(shapes_dm_kwargs, tmp_path, feature_cache=False)
    module = make_module(dm)
    module.vocab = dm.vocab
    module.train()
    cb = AttentionOverlayCallback(num_images=3, max_words=2, save_dir=str(tmp_path / "out"))
    cb.on_validation_epoch_end(stub_trainer(dm), module)
    assert module.training  # restored
    pngs = sorted((tmp_path / "out" / "epoch_03").glob("*.png"))
    assert pngs == sorted(cb.last_paths) and len(pngs) == 3
    assert all(len(w) <= 2 for w in cb.last_words.values())
    assert sorted(check_strip(p).shape[1] for p in pngs) == expected_widths(cb)


class _Untouchable:
    """A module stand-in that fails on any use."""

    def __getattr__(self, name: str) -> Any:
        raise AssertionError(f"the callback used the module ({name}) on a non-zero rank")


def test_nothing_happens_on_other_ranks(monkeypatch: pytest.MonkeyPatch) -> None:
    cb = AttentionOverlayCallback(num_images=2)
    trainer = stub_trainer(is_global_zero=False)  # no datamodule: loading would raise
    cb.setup(trainer, _Untouchable(), "fit")
    cb.on_validation_epoch_end(trainer, _Untouchable())
    assert cb.validation_epochs == 1 and cb._inputs is None and not cb.last_paths
    monkeypatch.setattr(rank_zero_only, "rank", 1)
    assert cb.log_overlays(stub_trainer(), _Untouchable()) is None  # rank_zero_only guard


def test_cadence_skips_sanity_checks_and_resumes(monkeypatch: pytest.MonkeyPatch) -> None:
    cb = AttentionOverlayCallback(every_n_epochs=2)
    calls: list[int] = []
    monkeypatch.setattr(cb, "log_overlays", lambda t, m: calls.append(cb.validation_epochs))
    cb.on_validation_epoch_end(stub_trainer(sanity_checking=True), None)
    for _ in range(5):
        cb.on_validation_epoch_end(stub_trainer(), None)
    assert calls == [2, 4]
    resumed = AttentionOverlayCallback(every_n_epochs=2)
    resumed.load_state_dict(cb.state_dict())
    assert resumed.validation_epochs == 5


@pytest.mark.parametrize("kwargs", [{"num_images": 0}, {"every_n_epochs": 0},
                                    {"max_words": 0}, {"upsample": "nearest"}])
def test_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        AttentionOverlayCallback(**kwargs)


@needs_java
def test_test_run_logs_a_predictions_table(shapes_dm_kwargs: dict, tmp_path: Path,
                                          tiny_fit: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """After `test`: one row per test image with its overlay, caption, references and CIDEr-D;
    the per-image CIDEr-D values average to the corpus CIDEr (pycocoevalcap's definition)."""
    import wandb

    monkeypatch.setenv("WANDB_MODE", "offline")
    for k, v in wandb_dirs(tmp_path).items():
        Path(v).mkdir(parents=True, exist_ok=True)
        monkeypatch.setenv(k, v)
    dm = make_dm(shapes_dm_kwargs, tmp_path, feature_cache=True)
    module = make_module(dm)
    module.hparams.compute_metrics = True
    cb = AttentionOverlayCallback(num_images=2, test_table_rows=5)
    logger = WandbLogger(offline=True, save_dir=str(tmp_path), project="test")
    try:
        trainer = tiny_fit(dm, module, tmp_path, callbacks=[cb], logger=logger)
        trainer.test(module, datamodule=dm)
    finally:
        wandb.finish()
    results = module.test_results
    n = len(dm.records("test"))
    assert len(results.cider) == n
    assert np.mean(list(results.cider.values())) == pytest.approx(results.metrics["CIDEr"])

    media = next((tmp_path / "wandb").glob("offline-run-*")) / "files" / "media"
    tables = [json.loads(p.read_text()) for p in (media / "table").rglob("*.json")]
    table = next(t for t in tables if t["columns"][-1] == "CIDEr")
    assert table["columns"] == ["overlay", "caption", "references", "CIDEr"]
    ids = [r.image_id for r in dm.records("test")[:5]]
    assert [row[1] for row in table["data"]] == [results.hypotheses[i] for i in ids]
    assert [row[2] for row in table["data"]] == ["\n".join(results.references[i]) for i in ids]
    assert [row[3] for row in table["data"]] == pytest.approx([results.cider[i] for i in ids])
    staged = {Image.open(p).size for p in (tmp_path / "wandb-data").rglob("*")
              if p.is_file() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"}
    assert {((len(results.words[i]) + 1) * S, S + LABEL) for i in ids} <= staged
