"""DDP half of tests/test_ddp.py: `python tests/ddp_worker.py SPEC.json OUT.json`.

Lightning's "ddp" strategy relaunches this script once per extra rank. Every rank validates and
tests the checkpoint in SPEC, then runs one training step while recording what its samplers
yield; rank zero writes the gathered results to OUT.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
import torch.distributed as dist

from captioning.callbacks import AttentionOverlayCallback
from captioning.data.datamodule import CaptionDataModule
from captioning.data.samplers import BucketBatchSampler
from captioning.data.sources import DataSource
from captioning.lit_module import CaptioningModule


def datamodule(data: dict[str, Any]) -> CaptionDataModule:
    """The data module of a spec's plain-data `data` (its `source` a class_path / init_args)."""
    return CaptionDataModule(**{**data, "source": DataSource.from_config(data["source"])})


def _gather(obj: Any) -> list[Any]:
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class SamplerProbe(L.Callback):
    """Records each rank's training batches (dataset indices) and sampler types."""

    def __init__(self) -> None:
        self.report: dict[str, Any] = {}
        self.val_sampler = ""

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val_sampler = type(trainer.val_dataloaders.sampler).__name__

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        batch_sampler = trainer.train_dataloader.batch_sampler
        self.report = _gather({
            "batch_sampler": type(batch_sampler).__name__,
            "is_bucketed": isinstance(batch_sampler, BucketBatchSampler),
            "inner_sampler": type(getattr(batch_sampler, "sampler", None)).__name__,
            "val_sampler": self.val_sampler,
            "batches": [list(map(int, b)) for b in batch_sampler],
        })


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(1)
    dm = datamodule(spec["data"])
    module = CaptioningModule.load_from_checkpoint(spec["checkpoint"], map_location="cpu")
    overlays = AttentionOverlayCallback(num_images=2, save_dir=spec["overlay_dir"],
                                        log_table=False)
    probe = SamplerProbe()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", logger=False,
                        callbacks=[overlays, probe], enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, max_steps=1, default_root_dir=spec["root"])
    trainer.validate(module, datamodule=dm, verbose=False)
    val = module.val_results
    overlay_paths = _gather(len(overlays.last_paths))
    trainer.test(module, datamodule=dm, verbose=False)
    test = module.test_results
    trainer.limit_val_batches = 0  # one training step, no validation
    trainer.fit(module, datamodule=dm)
    if trainer.is_global_zero:
        Path(out_path).write_text(json.dumps({
            "world_size": trainer.world_size,
            "val": {"metrics": val.metrics, "hypotheses": {str(k): v for k, v in
                                                           val.hypotheses.items()}},
            "test": {"metrics": test.metrics, "hypotheses": {str(k): v for k, v in
                                                             test.hypotheses.items()}},
            "overlays_per_rank": overlay_paths,
            "samplers": probe.report,
        }))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
