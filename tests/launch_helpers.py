"""Helpers of the launcher tests (tests/test_torchrun.py): callbacks that the `captioning fit`
processes of a multi-process run load by class path (`launch_helpers.RecordRankPairs`, with
tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from tiny_runs import batch_pairs


class RecordRankPairs(L.Callback):
    """Each rank appends the training pairs it trains on to `folder/rank{global rank}.jsonl`,
    one JSON line per batch: {"rank", "world", "epoch", "pairs": [[image id, token ids], ...],
    "input_dims": the dimensions of the batch's inputs (3: grids), "holds": for each call of the
    data module's `hold_grids` so far, whether it asked every rank's verdict}."""

    def __init__(self, folder: str) -> None:
        self.folder = folder
        self.holds: list[bool] = []  # each `hold_grids` call: with every rank's verdict?

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        dm = trainer.datamodule  # the callbacks' setup runs before the module's
        hold = dm.hold_grids

        def recorded(*args: Any, agree: Any = None, **kwargs: Any) -> None:
            self.holds.append(agree is not None)
            hold(*args, agree=agree, **kwargs)

        dm.hold_grids = recorded

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        line = {"rank": trainer.global_rank, "world": trainer.world_size,
                "epoch": trainer.current_epoch, "pairs": batch_pairs(batch),
                "input_dims": batch.images.dim(), "holds": self.holds}
        path = Path(self.folder) / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")


class SignalOneRank(L.Callback):
    """Sends `signal_name` to this process on rank `rank` only, as training step `step`
    starts (None: as the sanity check's first batch starts): a signal that reached one rank
    of a DDP run."""

    def __init__(self, rank: int, step: int | None, signal_name: str) -> None:
        self.rank, self.step, self.signal_name = rank, step, signal_name

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            os.kill(os.getpid(), getattr(signal, self.signal_name))

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if (trainer.sanity_checking and self.step is None and batch_idx == 0
                and trainer.global_rank == self.rank):
            os.kill(os.getpid(), getattr(signal, self.signal_name))
