"""Bad input, interruption and untrusted checkpoints: clear errors, nothing lost.

* Data: every image is checked when the data is set up (all bad files of all splits listed at
  once, before any step), odd-but-valid images train without a crash, skips are counted and
  logged to the loggers.
* Runs: Ctrl-C / SIGTERM / KeyboardInterrupt leave `last.ckpt`, and resuming it reproduces an
  uninterrupted run exactly (weights, optimiser, hard-attention baseline); a NaN input or an
  inf gradient stops the run naming the step, with the weights untouched.
* Checkpoints: plain data only, loadable with `weights_only=True`; an unsafe pickle is refused
  by `captioning fit/test` without running; a mismatched vocabulary or config is named.
* CLI: user errors become one `error:` line and a non-zero status.

Uses the session's tiny shapes dataset (conftest) and tiny models (resnet18 without weights,
2x2 grid, 16-32 dims, 64 px, cached features).
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
import yaml
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger
from PIL import Image, ImageFile

from captioning.callbacks import CheckpointOnInterrupt
from captioning.checkpoint import CheckpointError
from captioning.cli import main, parser_error_line
from captioning.data.datamodule import CaptionDataModule
from captioning.data.images import check_image
from captioning.data.readers import DataError
from captioning.lit_module import CHECKPOINT_RNG_KEY, CaptioningModule
from captioning.models.captioner import CaptionerConfig

REPO = Path(__file__).resolve().parent.parent
NET: dict[str, Any] = {"backbone": "resnet18", "weights": None, "grid_size": 2,
                       "image_size": 64, "embed_dim": 16, "hidden_dim": 32, "attn_dim": 16,
                       "dropout": 0.5}
BATCHES = 3  # training batches per epoch (of 8 pairs)


@pytest.fixture(autouse=True, scope="module")
def _one_thread() -> Iterator[None]:
    """Tiny models are op-overhead bound: one intra-op thread is faster on CPU."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _signal_handlers_restored() -> Iterator[None]:
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
                            eval_strategy="greedy", max_len=6)


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


def assert_same(a: dict[str, Any], b: dict[str, Any]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if k == "optimizer":
            assert a[k].keys() == b[k].keys()
            for i in a[k]:
                for name, t in a[k][i].items():
                    assert torch.equal(t, b[k][i][name]), f"optimizer state {i}.{name} differs"
        else:
            assert torch.equal(a[k], b[k]), f"{k} differs"


# ------------------------------------------------------------------------------------------
# Callbacks that interrupt or break a run (also used through the CLI, by class path)


class InterruptAt(L.Callback):
    """Interrupt fit: `how` = "KeyboardInterrupt" (raised at the start of epoch `epoch`),
    "SIGTERM" / "SIGINT" (sent to this process at the end of epoch `epoch`, or after training
    batch `batch` of it), `presses` times."""

    def __init__(self, how: str = "SIGTERM", epoch: int = 0, batch: int | None = None,
                 presses: int = 1) -> None:
        self.how, self.epoch, self.batch, self.presses = how, epoch, batch, presses

    def _signal(self) -> None:
        for _ in range(self.presses):
            os.kill(os.getpid(), getattr(signal, self.how))

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.how == "KeyboardInterrupt" and trainer.current_epoch == self.epoch:
            raise KeyboardInterrupt

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if self.how != "KeyboardInterrupt" and self.batch == batch_idx and \
                trainer.current_epoch == self.epoch:
            self._signal()

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.how != "KeyboardInterrupt" and self.batch is None and \
                trainer.current_epoch == self.epoch:
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


# ------------------------------------------------------------------------------------------
# Runs: interruption and exact resume


@pytest.fixture(scope="module")
def straight(shapes_dm_kwargs: dict, cache_dir: Path,
             tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], dict[str, Any]]:
    """Weights and optimiser state after 2 uninterrupted epochs (seed 0), per attention."""
    done: dict[str, dict[str, Any]] = {}

    def run(attention: str) -> dict[str, Any]:
        if attention not in done:
            L.seed_everything(0)
            dm = make_dm(shapes_dm_kwargs, cache_dir)
            module = make_module(dm, attention)
            trainer = make_trainer(tmp_path_factory.mktemp("straight") / "ckpt")
            trainer.fit(module, datamodule=dm)
            assert trainer.global_step == 2 * BATCHES
            done[attention] = snapshot(module, trainer)
        return done[attention]

    return run


@pytest.mark.parametrize(("attention", "how", "save_top_k"), [
    ("soft", "KeyboardInterrupt", 0),  # at epoch start: saved as the epoch boundary
    ("soft", "KeyboardInterrupt", -1),  # ModelCheckpoint's last.ckpt of that step is kept
    ("hard", "SIGTERM", 0),  # Lightning's graceful stop at the end of the epoch
    ("hard", "SIGINT", 0),  # first Ctrl-C: the same graceful stop
])
def test_interrupt_then_resume_equals_an_uninterrupted_run(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, straight: Callable,
        attention: str, how: str, save_top_k: int) -> None:
    expected = straight(attention)
    ckpt_dir = tmp_path / "ckpt"
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    module = make_module(dm, attention)
    stop = InterruptAt(how, epoch=1 if how == "KeyboardInterrupt" else 0)
    trainer = make_trainer(ckpt_dir, stop, save_top_k=save_top_k)
    with pytest.raises(SystemExit) as info:  # Lightning: sys.exit(1) / SIGTERMException
        trainer.fit(module, datamodule=dm)
    assert trainer.global_step == BATCHES  # one epoch, then the interruption
    if how != "KeyboardInterrupt":
        assert info.value.interrupt == how  # type: ignore[attr-defined]
        assert Path(info.value.checkpoint_path).parent == ckpt_dir  # type: ignore[attr-defined]
    last = ckpt_dir / "last.ckpt"
    checkpoint = torch.load(last, map_location="cpu", weights_only=True)
    assert checkpoint["global_step"] == BATCHES and CHECKPOINT_RNG_KEY in checkpoint

    L.seed_everything(123)  # resuming must not depend on the seed of the new process
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    module = make_module(dm, attention)
    trainer = make_trainer(ckpt_dir)
    trainer.fit(module, datamodule=dm, ckpt_path="last", weights_only=True)
    assert trainer.global_step == 2 * BATCHES
    assert_same(snapshot(module, trainer), expected)
    if attention == "hard":
        assert module.baseline.value.item() != 0.0


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_after_the_batch_and_a_second_press_at_once(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, presses: int) -> None:
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    module = make_module(dm)
    trainer = make_trainer(tmp_path / "ckpt", InterruptAt("SIGINT", batch=1, presses=presses))
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, datamodule=dm)
    # One press: the batch finishes (its step is taken), then training stops cleanly.
    # Two presses: KeyboardInterrupt at once (Lightning exits with status 1).
    assert info.value.code == (None if presses == 1 else 1)
    assert signal.getsignal(signal.SIGINT) is before  # the callback restored the handler
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2
    if presses == 1:  # resumes (mid-epoch: the rest of the epoch, then the next one)
        trainer = make_trainer(tmp_path / "ckpt")
        trainer.fit(make_module(dm), datamodule=dm, ckpt_path="last", weights_only=True)
        assert trainer.current_epoch == 2


# ------------------------------------------------------------------------------------------
# Non-finite values


@pytest.mark.parametrize(("attention", "what"), [("soft", "nan"), ("hard", "nan"),
                                                 ("soft", "inf_grad")])
def test_non_finite_values_stop_before_the_weights_change(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, attention: str,
        what: str) -> None:
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    module = make_module(dm, attention)
    breaker = BreakAt(what, batch=2)
    trainer = make_trainer(tmp_path / "ckpt", breaker, max_epochs=1)
    with pytest.raises(FloatingPointError) as info:
        trainer.fit(module, datamodule=dm)
    msg = str(info.value)
    assert "at global step 2" in msg and "stopping before" in msg
    if what == "nan":
        assert repr(breaker.image_id) in msg  # the image whose input is bad
    else:
        assert "captioner.decoder.out.weight" in msg  # the first non-finite gradient
    assert breaker.before is not None
    assert_same(snapshot(module, trainer), breaker.before)
    assert not (tmp_path / "ckpt" / "last.ckpt").exists()  # not an interruption: no save


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


def _leaves(obj: Any, where: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(obj, dict):
        for k, v in obj.items():
            assert isinstance(k, str | int), f"{where}: key {k!r}"
            yield from _leaves(v, f"{where}.{k}")
    elif isinstance(obj, list | tuple):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, obj


def test_checkpoint_holds_only_tensors_and_plain_data(fitted: Path) -> None:
    checkpoint = torch.load(fitted, map_location="cpu", weights_only=True)
    plain = (torch.Tensor, int, float, str, bool, type(None))
    odd = [(w, type(v).__name__) for w, v in _leaves(checkpoint) if not isinstance(v, plain)]
    assert not odd
    assert isinstance(checkpoint["captioning_vocab"], dict)
    assert checkpoint["captioning_model_config"]["hidden_dim"] == NET["hidden_dim"]


def test_mismatched_vocabulary_or_config_is_named(fitted: Path, shapes_dm_kwargs: dict,
                                                  cache_dir: Path, tmp_path: Path) -> None:
    dm = make_dm(shapes_dm_kwargs, cache_dir, max_vocab_size=12)  # another vocabulary
    trainer = make_trainer(tmp_path / "a", max_epochs=1)
    with pytest.raises(CheckpointError, match=r"vocabulary \(\d+ words\) is not the data's"):
        trainer.validate(make_module(dm), datamodule=dm, ckpt_path=str(fitted),
                         weights_only=True)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    trainer = make_trainer(tmp_path / "b", max_epochs=1)
    with pytest.raises(CheckpointError, match=r"do not fit this model.*hidden_dim=32 "
                                              r"\(this model 16\)"):
        trainer.validate(make_module(dm, hidden_dim=16), datamodule=dm, ckpt_path=str(fitted),
                         weights_only=True)
    data = torch.load(fitted, map_location="cpu", weights_only=True)
    del data["captioning_model_config"], data["hyper_parameters"]["net"]
    torch.save(data, tmp_path / "no_config.ckpt")
    with pytest.raises(CheckpointError, match="has no captioning model config"):
        trainer.validate(make_module(dm, hidden_dim=16), datamodule=dm,
                         ckpt_path=str(tmp_path / "no_config.ckpt"), weights_only=True)


class _Evil:
    """Unpickling this runs code: it creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))


def _evil_checkpoint(fitted: Path, folder: Path) -> tuple[Path, Path]:
    """A copy of a real checkpoint with a code-running object inside, and its marker file."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / "pwned"
    data = torch.load(fitted, map_location="cpu", weights_only=True)
    data["hyper_parameters"]["payload"] = _Evil(marker)
    path = folder / "evil.ckpt"
    torch.save(data, path)
    return path, marker


# ------------------------------------------------------------------------------------------
# CLI (in process: captioning.cli.main)


def _config(path: Path, shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path,
            callbacks: list[dict[str, Any]] = (), **trainer: Any) -> Path:
    """A complete `captioning fit` config for the tiny model and data."""
    data = {k: v for k, v in shapes_dm_kwargs.items()}
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
                  "compute_metrics": False, "eval_strategy": "greedy", "max_len": 6},
        "data": data,
    }
    path.write_text(yaml.safe_dump(cfg))
    return path


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def test_cli_sigterm_leaves_a_checkpoint_and_fit_resumes_it(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    ckpt_dir = tmp_path / "ckpt"
    stop = {"class_path": f"{__name__}.InterruptAt", "init_args": {"how": "SIGTERM"}}
    interrupted = _config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, [stop],
                          max_epochs=3)
    assert main(["fit", "--config", str(interrupted)]) == 143
    err = capsys.readouterr().err
    assert f"interrupted by SIGTERM; saved {ckpt_dir / 'last.ckpt'} (resume with " \
           "--ckpt_path last)" in err
    plain = _config(tmp_path / "b.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, max_epochs=2)
    # Resumed with the CLI's default weights_only=True, through LightningCLI's own read of
    # the checkpoint's hyperparameters.
    assert main(["fit", "--config", str(plain), "--ckpt_path", "last"]) == 0
    checkpoint = torch.load(ckpt_dir / "last.ckpt", weights_only=True)
    assert checkpoint["global_step"] == 2 * BATCHES and checkpoint["epoch"] == 2


def test_cli_decoding_settings_override_the_checkpoints(shapes_dm_kwargs: dict,
                                                        cache_dir: Path, tmp_path: Path) -> None:
    ckpt_dir = tmp_path / "ckpt"
    cfg = _config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir)
    assert main(["fit", "--config", str(cfg)]) == 0
    ckpt = ckpt_dir / "last.ckpt"
    assert torch.load(ckpt, weights_only=True)["hyper_parameters"]["max_len"] == 6
    out = tmp_path / "results"
    # Lightning alone would take compute_metrics False (no decoding), max_len 6 and
    # results_dir None from the checkpoint.
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(ckpt), "--model.max_len", "2",
                 "--model.compute_metrics", "true", "--model.results_dir", str(out)]) == 0
    captions = json.loads((out / "test_captions.json").read_text())
    assert captions and max(len(c["caption"].split()) for c in captions) <= 2
    assert max(len(c["caption"].split()) for c in captions) == 2  # an untrained model rambles


def test_cli_ctrl_c_exits_130_naming_the_checkpoint(shapes_dm_kwargs: dict, cache_dir: Path,
                                                    tmp_path: Path,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    stop = {"class_path": f"{__name__}.InterruptAt",
            "init_args": {"how": "KeyboardInterrupt", "epoch": 0}}
    ckpt_dir = tmp_path / "ckpt"
    cfg = _config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, ckpt_dir, [stop])
    assert main(["fit", "--config", str(cfg)]) == 130
    assert f"interrupted by Ctrl-C; saved {ckpt_dir / 'last.ckpt'}" in capsys.readouterr().err
    assert (ckpt_dir / "last.ckpt").is_file()


@pytest.mark.parametrize("command", ["fit", "validate", "test"])
def test_cli_loads_checkpoints_with_weights_only(command: str,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main([command, "--print_config"])
    assert yaml.safe_load(capsys.readouterr().out)["weights_only"] is True


def test_cli_non_finite_loss_is_one_error_line(shapes_dm_kwargs: dict, cache_dir: Path,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    nan = {"class_path": f"{__name__}.BreakAt", "init_args": {"what": "nan", "batch": 1}}
    cfg = _config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt", [nan])
    assert main(["fit", "--config", str(cfg)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert "non-finite training loss nan at global step 1" in line


@pytest.mark.parametrize("command", ["fit", "test"])
def test_cli_refuses_a_code_running_checkpoint(command: str, fitted: Path,
                                               shapes_dm_kwargs: dict, cache_dir: Path,
                                               tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    evil, marker = _evil_checkpoint(fitted, tmp_path / "evil")
    cfg = _config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main([command, "--config", str(cfg), "--ckpt_path", str(evil)]) == 1
    (line,) = _error_lines(capsys.readouterr().err)
    assert f"{evil}: refused to load" in line and "exec" in line
    assert "nothing from the file was run" in line
    assert not marker.exists()
    torch.load(evil, weights_only=False)  # the control: it really runs code
    assert marker.exists()


def test_cli_subprocess_refuses_a_code_running_checkpoint(fitted: Path, shapes_dm_kwargs: dict,
                                                          cache_dir: Path,
                                                          tmp_path: Path) -> None:
    evil, marker = _evil_checkpoint(fitted, tmp_path / "evil")
    cfg = _config(tmp_path / "c.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-m", "captioning.cli", "fit", "--config", str(cfg),
                           "--ckpt_path", str(evil)], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert proc.returncode == 1
    (line,) = _error_lines(proc.stderr)
    assert "refused to load" in line
    assert not marker.exists()


def _write_bad_json(path: Path) -> Path:
    path.write_text('{"images": [\n  {"filename": "a.png",,}\n]}')
    return path


@pytest.mark.parametrize(("args", "status", "words"), [
    (["fit", "--trainer.max_epochs", "abc"], 2,
     "--trainer.max_epochs: invalid value 'abc' (expected int or null)"),
    (["fit", "--model.net.attention", "soft2"], 2,
     "--model.net.attention: invalid value 'soft2' (expected one of 'soft', 'hard')"),
    (["fit", "--no_such_option", "1"], 2, "unrecognized arguments: --no_such_option 1"),
    (["fit", "--config", "{tmp}/missing.yaml"], 2, "--config: File does not exist"),
    (["fit", "--data.batch_size", "0"], 2, "batch_size must be >= 1, got 0"),
    (["test", "--ckpt_path", "{tmp}/missing.ckpt"], 1,
     "{tmp}/missing.ckpt: checkpoint file does not exist"),
    (["fit", "--data.dataset", "karpathy", "--data.split_file", "{tmp}/bad.json"], 1,
     "{tmp}/bad.json: line 2 column 24: field '(json)': malformed JSON"),
    (["fit", "--data.dataset", "karpathy", "--data.split_file", "{tmp}/none.json"], 1,
     "{tmp}/none.json: (file): field '(file)': file does not exist"),
])
def test_cli_user_errors_are_one_line(args: list[str], status: int, words: str,
                                      tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _write_bad_json(tmp_path / "bad.json")
    args = [a.replace("{tmp}", str(tmp_path)) for a in args]
    assert main([*args, "--trainer.logger", "false"]) == status
    err = capsys.readouterr().err
    assert "usage:" not in err
    (line,) = _error_lines(err)
    assert words.replace("{tmp}", str(tmp_path)) in line


def test_parser_error_line() -> None:
    assert parser_error_line('Parser key "data.on_bad_data":\n  Expected a typing.Literal['
                             "'fail', 'skip']. Got value: maybe") == \
        "--data.on_bad_data: invalid value 'maybe' (expected one of 'fail', 'skip')"
    assert parser_error_line("unrecognized arguments: --x") == "unrecognized arguments: --x"
    assert parser_error_line('Parser key "a":\n  Problem:\n    deep') == "--a: Problem: deep"


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(argv: Any) -> int:
        raise KeyError("a bug")

    monkeypatch.setattr("captioning.cli._shapes", broken)
    with pytest.raises(KeyError, match="a bug"):
        main(["shapes"])


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
    return {**shapes_dm_kwargs, "dataset": "karpathy", "min_word_count": 1,
            "split_file": str(messy_root / "dataset_shapes.json")}


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
    cfg = _config(tmp_path / "c.yaml", messy_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["fit", "--config", str(cfg)]) == 1
    err = capsys.readouterr().err
    (line,) = _error_lines(err)
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
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "root": str(root), "on_bad_data": "skip",
                              "feature_cache": False})
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


def test_user_given_settings_are_found_in_flags_and_config_files(tmp_path: Path) -> None:
    from captioning.cli import _given

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"beam_size": 5, "net": {"hard_decode": "argmax"}}}))
    model = tmp_path / "m.yaml"
    model.write_text(yaml.safe_dump({"init_args": {"max_len": 9}}))
    args = ["test", "--config", str(cfg), "--model", str(model), "--model.length_penalty=0.5",
            "--model.results_dir", "out"]
    assert _given(args, "model.beam_size") and _given(args, "model.net.hard_decode")
    assert _given(args, "model.max_len") and _given(args, "model.length_penalty")
    assert _given(args, "model.results_dir")
    assert not _given(args, "model.eval_strategy") and not _given(args, "model.forbid_unk")
    assert not _given(["test", "--config", str(tmp_path / "missing.yaml")], "model.beam_size")
