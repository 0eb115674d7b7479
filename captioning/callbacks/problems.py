"""The run folder's list of the data's problems, written as soon as a stage's data is set up."""

from __future__ import annotations

import logging
from pathlib import Path

import lightning.pytorch as pl

from captioning.data.problems import save_problems

log = logging.getLogger(__name__)


class DataProblemsFile(pl.Callback):
    """After the data module's `setup(stage)` (its records read, its images checked), global
    rank zero writes what `data.on_bad_data: skip` left out to `folder`'s `PROBLEMS_FILE`, the
    stage's section (none: the section goes). Written before the first step, so that a run
    killed later still leaves its list."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        dm = trainer.datamodule
        if not trainer.is_global_zero or not getattr(dm, "checked", False):
            return
        stage = str(getattr(stage, "value", stage))  # TrainerFn.FITTING -> "fit"
        saved = save_problems(self.folder, stage, dm.problems, "skipped by data.on_bad_data")
        if dm.problems:
            log.info("the %d skipped problems of the data are listed in %s",
                     len(dm.problems), saved)
