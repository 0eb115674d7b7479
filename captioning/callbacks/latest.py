"""`LatestCheckpoint`: `last.ckpt` is always the newest training state."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from lightning.pytorch.callbacks import ModelCheckpoint

from captioning.atomic import remove_stale_temporaries
from captioning.run_folder import RUN_CHECKPOINTS

log = logging.getLogger(__name__)


class LatestCheckpoint(ModelCheckpoint):
    """Write `dirpath/last.ckpt` at every training epoch end, every `every_n_train_steps`
    optimiser steps and every `every_n_minutes` minutes of training (0 turns either off),
    whichever comes first, and when training ends (e.g. at `max_time`) after the last save.
    Without a `dirpath` it writes to `default_root_dir/checkpoints`.

    Lightning's `ModelCheckpoint` takes one trigger (steps, time or epochs) and, with
    `save_top_k=0`, writes `last.ckpt` only when training ends; this subclass combines the
    three and keeps no other file. The best-by-metric checkpoint belongs to another
    `ModelCheckpoint` (`save_last: false`), so the two never overwrite each other. `last.ckpt`
    is overwritten in place (no `last-v1.ckpt`): it is the state `--ckpt_path last` resumes.
    Saving reads the RNG states and consumes none, so it does not change a run's results. When
    fit starts, temporary files of writers that died in `dirpath` are removed.
    """

    def __init__(self, dirpath: str | None = None, every_n_train_steps: int = 0,
                 every_n_minutes: float = 0.0, verbose: bool = False) -> None:
        if every_n_train_steps < 0 or every_n_minutes < 0:
            raise ValueError("LatestCheckpoint: every_n_train_steps and every_n_minutes must be "
                             f">= 0 (0: off), got {every_n_train_steps} and {every_n_minutes}")
        super().__init__(dirpath=dirpath, save_last=True, save_top_k=0, verbose=verbose,
                         save_on_train_epoch_end=True, enable_version_counter=False)
        self.every_n_train_steps = every_n_train_steps
        self.every_n_minutes = every_n_minutes
        self._saved_at = time.monotonic()

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.dirpath:  # where `CheckpointOnInterrupt` and `--ckpt_path last` look
            self.dirpath = str(Path(trainer.default_root_dir, RUN_CHECKPOINTS).resolve())
        super().setup(trainer, pl_module, stage)
        folder = Path(str(self.dirpath or ""))
        if stage == "fit" and trainer.is_global_zero and "://" not in str(folder) \
                and folder.is_dir():
            remove_stale_temporaries(folder)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        self._saved_at = time.monotonic()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        steps = self.every_n_train_steps
        due = steps > 0 and trainer.global_step % steps == 0
        if self.every_n_minutes > 0:  # rank 0 decides, so that every rank saves together
            late = time.monotonic() - self._saved_at >= 60.0 * self.every_n_minutes
            due = trainer.strategy.broadcast(late) or due
        # the last batch's state is saved at the epoch end, after validation and the epoch's hooks
        if due and not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self.save_latest(trainer)

    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_latest(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        pass  # the epoch-end save follows validation; nothing here depends on a metric

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.save_latest(trainer)

    def save_latest(self, trainer: L.Trainer) -> None:
        """Write `last.ckpt` unless training is not under way or it holds this step already."""
        if self._should_skip_saving_checkpoint(trainer):
            return
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._saved_at = time.monotonic()
        if self.verbose:
            log.info("saved %s (epoch %d, step %d)", self.last_model_path, trainer.current_epoch,
                     trainer.global_step)
