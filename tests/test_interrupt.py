"""Interruption and exact resume (captioning/callbacks/interrupt.py): Ctrl-C / SIGTERM /
KeyboardInterrupt leave `last.ckpt`, and resuming it reproduces an uninterrupted run exactly
(weights, optimiser, hard-attention baseline)."""

from __future__ import annotations

import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import pytest
import torch
from tiny_runs import (
    BATCHES,
    InterruptAt,
    assert_same,
    make_dm,
    make_module,
    make_trainer,
    snapshot,
)

from captioning.checkpoint import CHECKPOINT_RNG_KEY

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")


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
        assert module.objective.baseline.value.item() != 0.0


class CtrlCMidStep(L.Callback):
    """Ctrl-C inside training batch 1 of epoch 0: the first press as the batch starts (before
    its forward pass), with `presses=2` a second one between its backward pass and its
    optimiser step. Records the hooks that run from then on."""

    def __init__(self, presses: int) -> None:
        self.presses = presses
        self.batch: int | None = None
        self.events: list[str] = []

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        self.batch = batch_idx if trainer.current_epoch == 0 else None
        self.events.append(f"start {batch_idx}")
        if self.batch == 1:
            self.events.append("press")
            signal.raise_signal(signal.SIGINT)  # handled before raise_signal returns

    def on_after_backward(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.events.append(f"backward {self.batch}")
        if self.batch == 1 and self.presses == 2:
            self.events.append("press")
            signal.raise_signal(signal.SIGINT)

    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                 optimizer: Any) -> None:
        self.events.append(f"step {self.batch}")

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.events.append(f"end {batch_idx}")


@pytest.mark.parametrize("presses", [1, 2])
def test_ctrl_c_stops_after_the_batch_and_a_second_press_at_once(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path, presses: int) -> None:
    """Both presses come in the middle of batch 1's training step. One press: the step is
    finished (its optimiser step taken), no further batch starts, and `last.ckpt` holds step 2.
    A second press: KeyboardInterrupt there and then: the step's optimiser step is never taken,
    and `last.ckpt` holds the state before it (step 1)."""
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    module = make_module(dm)
    ctrl_c = CtrlCMidStep(presses)
    trainer = make_trainer(tmp_path / "ckpt", ctrl_c)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN when the suite runs in the background
    with pytest.raises(SystemExit) as info:
        trainer.fit(module, datamodule=dm)
    assert signal.getsignal(signal.SIGINT) is before  # the callback restored the handler
    checkpoint = torch.load(tmp_path / "ckpt" / "last.ckpt", weights_only=True)
    done = ["start 0", "backward 0", "step 0", "end 0", "start 1", "press", "backward 1"]
    if presses == 1:  # SIGTERMException (code None) at the next batch boundary
        assert info.value.code is None
        assert ctrl_c.events == [*done, "step 1", "end 1"]
        assert trainer.global_step == checkpoint["global_step"] == 2
        # resumes (mid-epoch: the rest of the epoch, then the next one)
        trainer = make_trainer(tmp_path / "ckpt")
        trainer.fit(make_module(dm), datamodule=dm, ckpt_path="last", weights_only=True)
        assert trainer.current_epoch == 2
    else:  # KeyboardInterrupt: Lightning exits with status 1
        assert info.value.code == 1 and isinstance(info.value.__context__, KeyboardInterrupt)
        assert ctrl_c.events == [*done, "press"]  # nothing of the step ran after it
        assert trainer.global_step == checkpoint["global_step"] == 1
        # the weights as the interrupted step left them: its update never happened
        torch.testing.assert_close(checkpoint["state_dict"], module.state_dict(), rtol=0, atol=0)
