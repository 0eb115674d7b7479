"""Shared helpers of the robustness tests (test_interrupt, test_lit_module, test_cli,
test_data_checks): tiny models and data modules, trainers that save `last.ckpt`, state
snapshots, callbacks that interrupt, kill or break a run or record its training pairs (also
used through the CLI, by class path `tiny_runs.InterruptAt` / `KillAt` / `BreakAt` /
`RecordPairs`), a checkpoint writer that blocks mid-save (`BlockingCheckpointIO`), a complete
`captioning fit` config (`cli_config`; `with_latest` gives it the shipped checkpoint layout),
and fixtures (`cache_dir`, `fitted`, `signal_handlers_restored`), which conftest.py makes
available to every test module.

Uses the session's tiny shapes dataset (conftest) and tiny models (resnet18 without weights,
2x2 grid, 16-32 dims, 64 px, cached features).
"""

from __future__ import annotations

import copy
import io
import json
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint

from captioning.callbacks import AtomicCheckpointIO, CheckpointOnInterrupt, LatestCheckpoint
from captioning.data.datamodule import CaptionDataModule
from captioning.data.sources import DataSource
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import CaptionerConfig, DecodeConfig

REPO = Path(__file__).resolve().parent.parent

NET: dict[str, Any] = {"backbone": "resnet18", "weights": None, "grid_size": 2,
                       "image_size": 64, "embed_dim": 16, "hidden_dim": 32, "attn_dim": 16,
                       "dropout": 0.5}
BATCHES = 3  # training batches per epoch (of 8 pairs)


def user_env(**extra: str) -> dict[str, str]:
    """This process's environment as a user's shell would have it, for a child command: no
    W&B settings, TORCH_HOME or proxies of the test run (the command sets its own); `extra`
    on top."""
    return {**{k: v for k, v in os.environ.items()
               if not k.startswith(("WANDB_", "TORCH_HOME")) and "proxy" not in k.lower()},
            **extra}


@pytest.fixture
def signal_handlers_restored() -> Iterator[None]:
    """Whatever a test does, SIGINT and SIGTERM keep their handlers."""
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    yield
    after = {s: signal.getsignal(s) for s in before}
    for s, handler in before.items():
        signal.signal(s, handler)
    assert after == before


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One feature cache for the module (keyed by the encoder weights)."""
    return tmp_path_factory.mktemp("features")


def make_dm(kwargs: dict[str, Any], cache_dir: Path, **over: Any) -> CaptionDataModule:
    return CaptionDataModule(**{**kwargs, "batch_size": 8, "feature_cache": True,
                                "cache_dir": str(cache_dir), **over})


def make_module(dm: CaptionDataModule, attention: str = "soft", **net: Any) -> CaptioningModule:
    config = CaptionerConfig(**{**NET, "attention": attention, **net})
    return CaptioningModule(vocab_size=dm.vocab_size, net=config, compute_metrics=False,
                            decode=DecodeConfig(strategy="greedy", max_len=6))


def make_trainer(ckpt_dir: Path, *callbacks: L.Callback, max_epochs: int = 2,
                 save_top_k: int = 0, logger: Any = False, **kw: Any) -> L.Trainer:
    ckpt = ModelCheckpoint(dirpath=str(ckpt_dir), save_last=True, save_top_k=save_top_k)
    return L.Trainer(max_epochs=max_epochs, limit_train_batches=BATCHES, limit_val_batches=1,
                     num_sanity_val_steps=0, logger=logger, enable_progress_bar=False,
                     enable_model_summary=False, accelerator="cpu", devices=1,
                     callbacks=[ckpt, CheckpointOnInterrupt(), *callbacks],
                     default_root_dir=str(ckpt_dir.parent), **kw)


def snapshot(module: L.LightningModule, trainer: L.Trainer | None = None) -> dict[str, Any]:
    """Every tensor of the module's state dict and of the optimiser state, cloned."""
    out: dict[str, Any] = {k: v.detach().clone() for k, v in module.state_dict().items()}
    if trainer is not None and trainer.optimizers:
        out["optimizer"] = copy.deepcopy(trainer.optimizers[0].state_dict()["state"])
    return out


def assert_same(a: dict[str, Any], b: dict[str, Any], *, rtol: float = 0.0,
                atol: float = 0.0) -> None:
    """`snapshot`s equal to the bit, or within `rtol` and `atol`."""
    assert a.keys() == b.keys()

    def equal(x: Any, y: Any) -> bool:
        if not (rtol or atol) or not torch.is_floating_point(x):
            return torch.equal(x, y)
        return torch.allclose(x, y, rtol=rtol, atol=atol)

    for k in a:
        if k == "optimizer" and not b[k]:  # fresh Adam: a skipped first fused step leaves
            for i in a[k]:  # its state created, but zero (step 0, moments 0)
                for name, t in a[k][i].items():
                    assert not t.any(), f"optimizer state {i}.{name} changed from fresh"
        elif k == "optimizer":
            assert a[k].keys() == b[k].keys()
            for i in a[k]:
                for name, t in a[k][i].items():
                    assert equal(t, b[k][i][name]), f"optimizer state {i}.{name} differs"
        else:
            assert equal(a[k], b[k]), f"{k} differs"


# ------------------------------------------------------------------------------------------
# Callbacks that interrupt or break a run (also used through the CLI, by class path)


class InterruptAt(L.Callback):
    """Interrupt fit: `how` = "KeyboardInterrupt" (raised at the start of epoch `epoch`),
    "SIGTERM" / "SIGINT" (sent to this process at the end of epoch `epoch`, or after training
    batch `batch` of it), `presses` times."""

    def __init__(self, how: str = "SIGTERM", epoch: int = 0, batch: int | None = None,
                 presses: int = 1, val_batch: int | None = None,
                 val_hook: str | None = None) -> None:
        self.how, self.epoch, self.batch, self.presses = how, epoch, batch, presses
        self.val_batch = val_batch  # instead: after this validation batch of epoch `epoch`
        self.val_hook = val_hook  # instead: KeyboardInterrupt in its validation's "start"/"end"

    def _interrupt_in(self, hook: str, trainer: L.Trainer) -> None:
        if self.val_hook == hook and trainer.current_epoch == self.epoch and \
                not trainer.sanity_checking:
            raise KeyboardInterrupt  # a second Ctrl-C: at once, wherever the run is

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._interrupt_in("start", trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._interrupt_in("end", trainer)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self.val_batch == batch_idx and trainer.current_epoch == self.epoch and \
                not trainer.sanity_checking:
            self._signal()

    def _signal(self) -> None:
        for _ in range(self.presses):
            os.kill(os.getpid(), getattr(signal, self.how))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.how == "KeyboardInterrupt" and trainer.current_epoch == self.epoch and \
                self.val_hook is None:
            raise KeyboardInterrupt

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.how != "KeyboardInterrupt" and self.batch == batch_idx and \
                self.val_batch is None and trainer.current_epoch == self.epoch:
            self._signal()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.how != "KeyboardInterrupt" and self.batch is None and \
                self.val_batch is None and trainer.current_epoch == self.epoch:
            self._signal()


class BreakAt(L.Callback):
    """At training batch `batch`: remember the state, then make the input NaN ("nan") or a
    parameter's gradient inf ("inf_grad")."""

    def __init__(self, what: str = "nan", batch: int = 2) -> None:
        self.what, self.batch = what, batch
        self.before: dict[str, Any] | None = None
        self.image_id: Any = None

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if batch_idx != self.batch:
            return
        self.before = snapshot(pl_module, trainer)
        if self.what == "nan":
            batch.images[1] = float("nan")
            self.image_id = batch.image_ids[1]
        else:
            p = pl_module.captioner.decoder.out.weight
            p.register_hook(lambda g: torch.full_like(g, math.inf))


class KillAt(L.Callback):
    """`kill -9` this process at the start of training batch `batch` of epoch `epoch` (after
    the checkpoints of the step before were saved)."""

    def __init__(self, epoch: int = 0, batch: int = 0) -> None:
        self.epoch, self.batch = epoch, batch

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if (trainer.current_epoch, batch_idx) == (self.epoch, self.batch):
            os.kill(os.getpid(), signal.SIGKILL)


def batch_pairs(batch: Any) -> list[list[Any]]:
    """A batch's training pairs: [[image id, caption token ids], ...]."""
    return [[str(i), c[:n].tolist()] for i, c, n in
            zip(batch.image_ids, batch.captions, batch.lengths.tolist(), strict=True)]


class RecordPairs(L.Callback):
    """Append each training pair the model sees to `path`, one JSON line per batch:
    [epoch, [[image id, caption token ids], ...]] (flushed, so a killed run keeps its lines)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps([trainer.current_epoch, batch_pairs(batch)]) + "\n")


class BlockingCheckpointIO(AtomicCheckpointIO):
    """`AtomicCheckpointIO` whose save number `block_at` (1-based) writes half the checkpoint,
    creates `marker`, then blocks (for a test to `kill -9` the process during the save)."""

    def __init__(self, marker: str, block_at: int = 2) -> None:
        super().__init__()
        self.marker, self.block_at, self.saves = marker, block_at, 0

    def write_file(self, checkpoint: dict[str, Any], tmp: Path) -> None:
        self.saves += 1
        if self.saves < self.block_at:
            return super().write_file(checkpoint, tmp)
        buffer = io.BytesIO()
        torch.save(checkpoint, buffer)
        with open(tmp, "wb") as f:
            f.write(buffer.getvalue()[: len(buffer.getvalue()) // 2])
            f.flush()
        Path(self.marker).touch()
        time.sleep(600)


# ------------------------------------------------------------------------------------------
# Checkpoints


@pytest.fixture(scope="module")
def fitted(shapes_dm_kwargs: dict, cache_dir: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Path:
    """last.ckpt of one soft-attention epoch."""
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    ckpt_dir = tmp_path_factory.mktemp("fitted") / "ckpt"
    make_trainer(ckpt_dir, max_epochs=1).fit(make_module(dm), datamodule=dm)
    return ckpt_dir / "last.ckpt"


# ------------------------------------------------------------------------------------------
# CLI (in process: captioning.cli.main)


def cli_config(path: Path, shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path,
            callbacks: list[dict[str, Any]] = (), **trainer: Any) -> Path:
    """A complete `captioning fit` config for the tiny model and data."""
    data = {k: v.config() if isinstance(v, DataSource) else v  # class_path / init_args
            for k, v in shapes_dm_kwargs.items()}
    data.update(batch_size=8, feature_cache=True, cache_dir=str(cache_dir))
    cfg = {
        "seed_everything": 0,
        "trainer": {"accelerator": "cpu", "devices": 1, "max_epochs": 1,
                    "limit_train_batches": BATCHES, "limit_val_batches": 1,
                    "num_sanity_val_steps": 0, "logger": False, "enable_progress_bar": False,
                    "enable_model_summary": False, "default_root_dir": str(ckpt_dir.parent),
                    "callbacks": [
                        {"class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
                         "init_args": {"dirpath": str(ckpt_dir), "save_last": True,
                                       "save_top_k": 0}},
                        {"class_path": "captioning.callbacks.CheckpointOnInterrupt"},
                        *callbacks],
                    **trainer},
        "model": {"net": {k: v for k, v in NET.items() if k != "image_size"},
                  "compute_metrics": False, "decode": {"strategy": "greedy", "max_len": 6}},
        "data": data,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def with_latest(cfg: Path, **latest: Any) -> Path:
    """A `cli_config` file rewritten to the shipped configs' checkpoint layout: the best by
    val/loss (no last.ckpt), `LatestCheckpoint` (its `latest` arguments) and
    `AtomicCheckpointIO`."""
    data = yaml.safe_load(cfg.read_text())
    trainer = data["trainer"]
    best, *rest = trainer["callbacks"]
    best["init_args"].update(save_last=False, save_top_k=1, monitor="val/loss",
                             filename="best-{epoch:02d}")
    latest_cb = {"class_path": "captioning.callbacks.LatestCheckpoint",
                 "init_args": {"dirpath": best["init_args"]["dirpath"], **latest}}
    trainer["callbacks"] = [best, latest_cb, *rest]
    trainer.setdefault("plugins", [{"class_path": "captioning.callbacks.AtomicCheckpointIO"}])
    cfg.write_text(yaml.safe_dump(data))
    return cfg


def latest_trainer(ckpt_dir: Path, *callbacks: L.Callback, max_epochs: int = 2,
                   every_n_train_steps: int = 0, plugins: Any = None, **kw: Any) -> L.Trainer:
    """`make_trainer` with the shipped configs' checkpoint layout (see `with_latest`) and
    every training batch (no `limit_train_batches`)."""
    best = ModelCheckpoint(dirpath=str(ckpt_dir), monitor="val/loss", save_top_k=1,
                           filename="best-{epoch:02d}")
    latest = LatestCheckpoint(dirpath=str(ckpt_dir), every_n_train_steps=every_n_train_steps)
    return L.Trainer(max_epochs=max_epochs, limit_val_batches=1, num_sanity_val_steps=0,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     accelerator="cpu", devices=1, default_root_dir=str(ckpt_dir.parent),
                     callbacks=[best, latest, CheckpointOnInterrupt(), *callbacks],
                     plugins=plugins or [AtomicCheckpointIO()], **kw)


def error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def tiny_encoder() -> Any:
    """A frozen resnet18 without weights, pooled to a 2x2 grid, from seed 0."""
    from captioning.models.encoder import CNNEncoder

    torch.manual_seed(0)
    return CNNEncoder(backbone="resnet18", weights=None, grid_size=2)


def print_config(*args: str) -> dict[str, Any]:
    """The config `captioning ARGS --print_config` prints, parsed."""
    from contextlib import redirect_stdout

    from captioning.cli import main

    out = io.StringIO()
    with redirect_stdout(out), pytest.raises(SystemExit) as exit_info:
        main([*args, "--print_config"])
    assert exit_info.value.code in (0, None)
    return yaml.safe_load(out.getvalue())
