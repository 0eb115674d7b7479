"""Helpers of the launcher tests (tests/test_torchrun.py): a callback that the `captioning fit`
processes of a multi-process run load by class path (`launch_helpers.RecordRankPairs`, with
tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L
from tiny_runs import batch_pairs


class RecordRankPairs(L.Callback):
    """Each rank appends the training pairs it trains on to `folder/rank{global rank}.jsonl`,
    one JSON line per batch: {"rank", "world", "epoch", "pairs": [[image id, token ids], ...],
    "input_dims": the dimensions of the batch's inputs (3: grids)}."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        line = {"rank": trainer.global_rank, "world": trainer.world_size,
                "epoch": trainer.current_epoch, "pairs": batch_pairs(batch),
                "input_dims": batch.images.dim()}
        path = Path(self.folder) / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
