"""Helpers of the launcher tests (tests/test_torchrun.py): a callback that the `captioning fit`
processes of a multi-process run load by class path (`launch_helpers.RecordRankPairs`, with
tests/ on PYTHONPATH)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import lightning.pytorch as L


class RecordRankPairs(L.Callback):
    """Each rank appends the training pairs it trains on to `folder/rank{global rank}.jsonl`,
    one JSON line per batch: {"rank", "world", "epoch", "pairs": [[image id, token ids], ...]}."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any,
                             batch_idx: int) -> None:
        pairs = [[str(i), c[:n].tolist()] for i, c, n in
                 zip(batch.image_ids, batch.captions, batch.lengths.tolist(), strict=True)]
        line = {"rank": trainer.global_rank, "world": trainer.world_size,
                "epoch": trainer.current_epoch, "pairs": pairs}
        path = Path(self.folder) / f"rank{trainer.global_rank}.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(line) + "\n")
