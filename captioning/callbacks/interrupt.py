"""`CheckpointOnInterrupt`: Ctrl-C and SIGTERM stop training cleanly and leave `last.ckpt`
where `--ckpt_path last` finds it."""

from __future__ import annotations

import contextlib
import copy
import logging
import signal
import threading
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch

from captioning.distributed import RankZeroFailed, all_reduce, is_distributed
from captioning.locks import Terminated
from captioning.run_folder import RUN_CHECKPOINTS

log = logging.getLogger(__name__)

#: A rank's vote to stop a DDP run, by index; the largest wins: none, SIGTERM, Ctrl-C.
VOTES = (None, "SIGTERM", "SIGINT")


class CheckpointOnInterrupt(L.Callback):
    """Save the last checkpoint when `fit` is interrupted, so that `--ckpt_path last` resumes.

    Interruptions are Ctrl-C (SIGINT), SIGTERM and a `KeyboardInterrupt` raised anywhere in the
    training loop. With `graceful_sigint` (the default) the first Ctrl-C during training asks
    for the same clean stop Lightning gives SIGTERM: the current batch finishes, then training
    stops; a second Ctrl-C interrupts at once. Either way the trainer state (weights, optimiser,
    loops, callbacks, RNG states) is written to the `ModelCheckpoint`'s last-checkpoint path
    (`dirpath/last.ckpt`, where `ckpt_path="last"` looks) before the run ends, unless a
    `ModelCheckpoint` already saved its last checkpoint at this very step (e.g. at the end of
    the epoch the interruption followed): that file is the state to resume. Other exceptions
    (a non-finite loss, a bug) save nothing: the previous `last.ckpt` stays the one to resume.
    Nothing is saved when the interruption comes before training started (setup, restoring),
    so a resume interrupted early never overwrites the checkpoint it resumes from.

    The interruption propagates as before (`KeyboardInterrupt`: Lightning exits with status 1;
    SIGTERM / graceful Ctrl-C: `SIGTERMException`); the exception gets two attributes,
    `interrupt` ("SIGINT", "SIGTERM" or "KeyboardInterrupt") and `checkpoint_path`, which the
    `captioning` command reports.

    Resuming reproduces an uninterrupted run exactly, from an epoch boundary or from within an
    epoch: the data order is seeded per epoch, the training loader saves its place in the
    epoch (`captioning.data.samplers.ResumableDataLoader`) and `CaptioningModule` stores the
    RNG states.

    Under DDP the ranks stop together: from the sanity check on, a signal only casts this
    rank's vote, and every rank reads the votes at the end of each training batch, of each
    validation batch of the fit and of each training epoch (a one-number all-reduce), so that
    all of them stop at the same point and save one checkpoint together, whichever rank the
    signal reached. (Lightning's own SIGTERM handler sets each rank's flag when its signal
    comes, which a rank then acts on alone, leaving the others in a collective it never
    joins.) Where rank zero is stopped while it scores the validation (SIGTERM's `Terminated`),
    the others stop with its `RankZeroFailed`, which carries the same `interrupt`: every rank
    then saves the checkpoint, as for any interruption of the validation.
    """

    def __init__(self, graceful_sigint: bool = True) -> None:
        super().__init__()
        self.graceful_sigint = graceful_sigint
        self.saved_path: Path | None = None  # the checkpoint written by the last interruption
        self._training = False
        self._stop_requested = False
        self._trainer: L.Trainer | None = None
        self._previous_handler: Any = None
        self._previous_sigterm: Any = None  # Lightning's SIGTERM handler, while ours votes
        self._cause: str | None = None  # the signal the stop was asked for by
        self._voting = False  # DDP: a signal is a vote that every rank reads at each batch end
        self._vote = 0  # this rank's: an index into VOTES
        self._epoch_start = False  # saving an interruption that came before the epoch's batches
        self._validating = False  # saving an interruption of the epoch's validation
        # the other callbacks' states as the fit's latest validation started, and its step
        self._before_validation: tuple[tuple[int, int], dict[str, Any]] | None = None

    # -- lightning hooks -------------------------------------------------------------------
    def on_sanity_check_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit":
            self._install(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = True
        self._install(trainer)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self._count_votes(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._count_votes(trainer)  # a signal after the epoch's last batch: the fit loop stops

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        if self._training and not trainer.sanity_checking:
            self._count_votes(trainer)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A checkpoint saved during this validation resumes into it from its start: the other
        # callbacks' states go in as they were then, or the hooks of its end that ran before
        # the interruption (EarlyStopping's patience, a best score) would count it twice.
        self._before_validation = None
        if trainer.state.fn != "fit" or trainer.sanity_checking:
            return
        try:
            states = {cb.state_key: copy.deepcopy(cb.state_dict())
                      for cb in trainer.callbacks if cb is not self}
        except Exception as e:  # a state that cannot be copied: saved as it is then
            log.debug("CheckpointOnInterrupt: callback states not kept (%s)", e)
            return
        self._before_validation = (_validation_key(trainer), states)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False
        self._restore_handlers()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_handlers()
        self._trainer = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        try:  # ours stay while the checkpoint is saved: a second signal is one more vote
            self._on_exception(trainer, exception)
        finally:
            self._restore_handlers()

    def _on_exception(self, trainer: L.Trainer, exception: BaseException) -> None:
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, KeyboardInterrupt):
            cause = "KeyboardInterrupt"
        elif isinstance(exception, SIGTERMException):
            cause = self._cause or "SIGTERM"
        elif isinstance(exception, (Terminated, RankZeroFailed)) and exception.interrupt:
            cause = exception.interrupt  # SIGTERM while scoring: rank zero's, on every rank
        else:
            return
        with contextlib.suppress(AttributeError):
            exception.interrupt = cause  # type: ignore[attr-defined]
        if not self._training or trainer.state.fn != "fit":
            log.warning("%s before training started: no checkpoint saved", cause)
            return
        self._training = False
        # In validation, a last checkpoint of this step (its last batch's) would resume past
        # the validation: a new one is saved, to resume into it.
        existing = None if trainer.validating else _current_last_checkpoint(trainer)
        try:
            path = existing or self.save(trainer)
        except FloatingPointError as e:  # a non-finite step was still being checked
            log.warning("%s after a non-finite step: no checkpoint saved (%s)", cause, e)
            return
        self.saved_path = path
        with contextlib.suppress(AttributeError):
            exception.checkpoint_path = path  # type: ignore[attr-defined]
        log.warning("%s at epoch %d, step %d: %s %s; resume with `--ckpt_path last`", cause,
                    trainer.current_epoch, trainer.global_step,
                    "the last checkpoint is up to date:" if existing else "saved", path)

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        if self._epoch_start:
            _as_epoch_boundary(checkpoint)
        if self._validating:
            _as_validation_start(checkpoint)
            states, kept = checkpoint.get("callbacks"), self._before_validation
            if isinstance(states, dict) and kept is not None \
                    and kept[0] == _validation_key(trainer):  # this validation's, no earlier one's
                states.update({k: v for k, v in kept[1].items() if k in states and v})

    # -- work ------------------------------------------------------------------------------
    def save(self, trainer: L.Trainer) -> Path:
        """Write the trainer state to `last_checkpoint_path(trainer)`; returns the path."""
        path = last_checkpoint_path(trainer)
        for cb in _model_checkpoints(trainer):  # the file is now the last checkpoint
            if Path(cb.dirpath or "") == path.parent:
                cb.last_model_path = str(path)
        # Interrupted in on_train_epoch_start: Lightning would resume such a checkpoint by
        # skipping the epoch, so it is saved as the boundary before the epoch instead.
        progress = trainer.fit_loop.epoch_progress.current
        self._epoch_start = progress.ready == progress.started + 1
        self._validating = trainer.validating
        try:
            trainer.save_checkpoint(path)
        finally:
            self._epoch_start = self._validating = False
        self.saved_path = path
        return path

    def _on_sigint(self, signum: int, frame: Any) -> None:
        trainer = self._trainer
        connector = getattr(trainer, "_signal_connector", None)
        if self._stop_requested or connector is None or not hasattr(connector, "received_sigterm"):
            raise KeyboardInterrupt
        self._stop_requested = True
        if self._voting:
            self._vote = max(self._vote, VOTES.index("SIGINT"))
        else:  # Lightning's own graceful-stop flag: the loops raise SIGTERMException at the
            # next batch (or epoch) boundary, after the step's bookkeeping is complete.
            connector.received_sigterm, self._cause = True, "SIGINT"
        log.warning("Ctrl-C: stopping after the current batch and saving a checkpoint "
                    "(press Ctrl-C again to stop at once)")

    def _on_sigterm(self, signum: int, frame: Any) -> None:
        self._vote = max(self._vote, VOTES.index("SIGTERM"))
        log.warning("SIGTERM: stopping with the other ranks after the current batch")

    def _install(self, trainer: L.Trainer) -> None:
        """Our handlers, once a fit, after Lightning's (it installs its own just before the
        sanity check, and restores every handler at teardown, which keeps that restore right).
        """
        if self._trainer is trainer:
            return  # installed as the sanity check started
        self._trainer, self._stop_requested, self._cause, self._vote = trainer, False, None, 0
        main = threading.current_thread() is threading.main_thread()
        if self.graceful_sigint and main:
            self._previous_handler = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)
        self._voting = trainer.world_size > 1 and is_distributed()
        if not self._voting:
            return
        connector = getattr(trainer, "_signal_connector", None)
        if getattr(connector, "received_sigterm", False):  # came before: a vote too
            connector.received_sigterm, self._vote = False, VOTES.index("SIGTERM")
        if main:
            self._previous_sigterm = signal.getsignal(signal.SIGTERM)
            signal.signal(signal.SIGTERM, self._on_sigterm)

    def _count_votes(self, trainer: L.Trainer) -> None:
        """DDP: every rank's vote; where any asks to stop, every rank sets Lightning's flag
        now, at the same point, and its loops raise `SIGTERMException` there. The all-reduce
        waits for the device's queue, as Lightning's broadcast of rank zero's flag at each
        batch's start already does under DDP."""
        if not self._voting or self._cause is not None:
            return
        ours = torch.tensor([self._vote], device=trainer.strategy.root_device)
        vote = int(all_reduce(ours, "max").item())
        if vote:
            self._cause = VOTES[vote]
            trainer._signal_connector.received_sigterm = True

    def _restore_handlers(self) -> None:
        if threading.current_thread() is threading.main_thread():
            for signum, previous in ((signal.SIGINT, self._previous_handler),
                                     (signal.SIGTERM, self._previous_sigterm)):
                if previous is not None:
                    signal.signal(signum, previous)
        self._previous_handler = self._previous_sigterm = None
        self._voting = False


def _validation_key(trainer: Any) -> tuple[int, int]:
    """Which validation of the fit is running: its epoch and training step."""
    return int(trainer.current_epoch), int(trainer.global_step)


def _as_epoch_boundary(checkpoint: dict[str, Any]) -> None:
    """Rewrite the loop state of a checkpoint taken in `on_train_epoch_start` into the state of
    the boundary before that epoch (the epoch not started, its batch counters at zero)."""
    try:
        fit = checkpoint["loops"]["fit_loop"]
        for part in ("total", "current"):
            fit["epoch_progress"][part]["ready"] = fit["epoch_progress"][part]["started"]
        for key in ("epoch_loop.batch_progress", "epoch_loop.scheduler_progress",
                    "epoch_loop.automatic_optimization.optim_progress"):
            _zero_current(fit[key])
        fit["epoch_loop.batch_progress"]["is_last_batch"] = False
    except (KeyError, TypeError) as e:  # another Lightning version's layout
        log.warning("CheckpointOnInterrupt: unknown loop state layout (%s); the checkpoint may "
                    "resume after the interrupted epoch", e)


def _as_validation_start(checkpoint: dict[str, Any]) -> None:
    """Rewrite the loop state of a checkpoint taken during the epoch's validation into the state
    Lightning resumes into that validation from its first batch (a batch started, none
    processed): resumed as saved, it would skip it (no val scores, no best checkpoint), and
    resumed mid-way, it would score the batches after the interruption only."""
    try:
        val = checkpoint["loops"]["fit_loop"]["epoch_loop.val_loop.batch_progress"]
        for part in ("total", "current"):
            val[part] = {"ready": 1, "started": 1, "processed": 0, "completed": 0}
        val["is_last_batch"] = False
    except (KeyError, TypeError) as e:  # another Lightning version's layout
        log.warning("CheckpointOnInterrupt: unknown loop state layout (%s); the checkpoint may "
                    "resume after the interrupted validation", e)


def _zero_current(state: dict[str, Any]) -> None:
    """Zero every per-epoch ("current") progress counter in a loop-progress state dict."""
    for key, value in state.items():
        if key == "current" and isinstance(value, dict):
            state[key] = {k: 0 for k in value}
        elif isinstance(value, dict):
            _zero_current(value)


def _current_last_checkpoint(trainer: L.Trainer) -> Path | None:
    """The last checkpoint a `ModelCheckpoint` already wrote at the current step, if any. Every
    DDP rank decides alike: from the callback's state, not from a file that only the nodes
    sharing rank zero's disk can see."""
    for cb in _model_checkpoints(trainer):
        path = Path(cb.last_model_path) if cb.last_model_path else None
        if (cb.save_last and path is not None
                and getattr(cb, "_last_global_step_saved", None) == trainer.global_step):
            return path
    return None


def _model_checkpoints(trainer: L.Trainer) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [cb for cb in getattr(trainer, "checkpoint_callbacks", [])
            if isinstance(cb, ModelCheckpoint)]


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where `ckpt_path="last"` looks: the last checkpoint (`dirpath/last.ckpt`) of the first
    `ModelCheckpoint` that saves one (e.g. `LatestCheckpoint`), else of the first one;
    `default_root_dir/checkpoints/last.ckpt` without any."""
    for cb in sorted(_model_checkpoints(trainer), key=lambda cb: not cb.save_last):
        if cb.dirpath:
            name = f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
            if "{" in name:  # a formatted last name ("{epoch}-last"): keep the current file
                return Path(cb.last_model_path or Path(cb.dirpath) / "last.ckpt")
            return Path(cb.dirpath) / name
    return Path(trainer.default_root_dir) / RUN_CHECKPOINTS / "last.ckpt"
