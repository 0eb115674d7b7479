"""`CaptionWriter`: the captions of `Trainer.predict` as one COCO-style results JSON.

The JSON is a list, in input order, of `{"file_name": path as given, "caption": text,
"score": Σ log p}` (plus `"alphas"` / `"overlay"`: the files written for the image, of its first
caption; with several captions an image, `"captions"`: each one's `{"caption", "score"}`, best
first for beams). Images that failed to load are reported on stderr (`error: path: reason`, one
line each) and left out.

Every rank appends its batches to its own shard (`OUT.rank<r>.jsonl`, one record or failure
per line) as they are decoded; when every rank is done (the `teardown` hook, after a barrier)
rank zero merges the shards, each input index once (a sampler that pads with repeats cannot
duplicate an image), writes the JSON atomically (a temporary file in the same folder, then
`os.replace`) and removes the shards. With several nodes the output folder must be shared by
all of them. The totals (`captioned`, `failed`) are broadcast, so every rank knows them.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import lightning.pytorch as L
import numpy as np
from lightning.pytorch.callbacks import BasePredictionWriter

from captioning.atomic import naming, remove_stale_temporaries, write_atomic, write_text_atomic
from captioning.viz import caption_strips, save_strip_png


def _report(message: str) -> None:
    """One `error: ...` line on stderr (the commands' format)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def write_results_json(records: Sequence[dict[str, Any]], path: Path) -> None:
    """A JSON list, one record per line, written atomically (`captioning.atomic`): a reader
    never sees a partial file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join(json.dumps(r, ensure_ascii=False) for r in records)
    write_text_atomic(path, f"[\n{body}\n]\n" if records else "[]\n")


def _savez(path: Path, arrays: dict[str, Any]) -> None:
    with open(path, "wb") as f:  # a file object: np.savez would append .npz to a name
        np.savez(f, **arrays)


class CaptionWriter(BasePredictionWriter):
    """Write the captions of `Trainer.predict` (`CaptioningModule.predict_step` over
    `captioning.data.predict` batches) to the JSON file `out`.

    `alphas`: also write each image's attention maps as `NAME.npz` (`alphas`: (T, gh, gw)
    float32, α_t of the t-th decoded word; `words`: the T words) into that folder, or into
    `OUT-STEM_alphas/` beside `out` when True. `overlays`: a folder for one attention strip PNG
    per image. `names[i]`: the file name (`.png`; `.npz` for the maps) of input i; default
    `STEM-i.png`. After `predict`, `captioned` and `failed` hold the totals on every rank.
    """

    def __init__(self, out: str | Path, *, alphas: bool | str | Path = False,
                 overlays: str | Path | None = None, names: Sequence[str] | None = None) -> None:
        super().__init__("batch")
        self.out = Path(out)
        if alphas is True:
            alphas = self.out.with_name(f"{self.out.stem}_alphas")
        self.alphas = Path(alphas) if alphas else None
        self.overlays = Path(overlays) if overlays else None
        self.names = list(names) if names is not None else None
        self.captioned = self.failed = 0
        self._shard: TextIO | None = None

    def shard_path(self, rank: int) -> Path:
        """Where rank `rank` writes its records while predicting."""
        return self.out.with_name(f"{self.out.name}.rank{rank}.jsonl")

    def file_name(self, index: int, path: str) -> str:
        """The overlay PNG name of input `index` (the α maps use its stem)."""
        return self.names[index] if self.names else f"{Path(path).stem or 'image'}-{index}.png"

    # -- every rank: one shard -----------------------------------------------------------------
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if stage != "predict":
            return
        self.captioned = self.failed = 0
        for folder in (self.out.parent, self.alphas, self.overlays):
            if folder is not None:
                folder.mkdir(parents=True, exist_ok=True)
                remove_stale_temporaries(folder)  # a killed run's writes
        shard = self.shard_path(trainer.global_rank)
        self._shard = open(shard, "w", encoding="utf-8")  # noqa: SIM115  # closed at the end

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           prediction: dict[str, Any], batch_indices: Sequence[int] | None,
                           batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        lines: list[dict[str, Any]] = []
        for index, path, message in batch.failures:
            _report(message)
            lines.append({"index": index, "file_name": path, "error": message})
        records = [{"index": i, "file_name": p, "caption": c, "score": s} for i, p, c, s in
                   zip(prediction["indices"], prediction["paths"], prediction["captions"],
                       prediction["scores"])]
        for rec, alternatives in zip(records, prediction.get("alternatives", ())):
            rec["captions"] = alternatives
        if records and self.alphas is not None:
            self._write_alphas(pl_module, prediction, records)
        if records and self.overlays is not None:
            lines += self._write_overlays(pl_module, batch, prediction, records)
        assert self._shard is not None, "on_predict_start opens the shard"
        try:
            self._shard.write("".join(json.dumps(r, ensure_ascii=False) + "\n"
                                      for r in records + lines))
            self._shard.flush()
        except OSError as e:
            raise naming(self.shard_path(trainer.global_rank), e) from None

    def _write_alphas(self, pl_module: Any, prediction: dict[str, Any],
                      records: list[dict[str, Any]]) -> None:
        gh, gw = pl_module.captioner.grid
        folder = self.alphas
        assert folder is not None
        alphas = prediction["generation"].alphas.float().cpu().numpy()
        for k, (rec, words) in enumerate(zip(records, prediction["words"])):
            name = Path(self.file_name(rec["index"], rec["file_name"])).with_suffix(".npz").name
            target = folder / name
            arrays = {"alphas": alphas[k, : len(words)].reshape(len(words), gh, gw),
                      "words": np.array(words, dtype=str)}
            write_atomic(target, lambda tmp, a=arrays: _savez(tmp, a))
            rec["alphas"] = str(target)

    def _write_overlays(self, pl_module: Any, batch: Any, prediction: dict[str, Any],
                        records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """One strip per image (hard models mark the location); returns a failure per strip
        that could not be written (each reported)."""
        gen, words = prediction["generation"], prediction["words"]
        hard = pl_module.net_config.attention == "hard"
        _, strips = caption_strips(batch.images, gen.alphas, pl_module.captioner.grid, words,
                                   points=gen.locations if hard else None)
        failures: list[dict[str, Any]] = []
        folder = self.overlays
        assert folder is not None
        for rec, strip in zip(records, strips):
            target = folder / self.file_name(rec["index"], rec["file_name"])
            try:
                rec["overlay"] = str(save_strip_png(strip, target))
            except OSError as e:
                message = f"{target}: cannot write the overlay ({e.strerror or e})"
                _report(message)
                failures.append({"index": rec["index"], "file_name": rec["file_name"],
                                 "error": message})
        return failures

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        """An interrupted or failed run leaves no partial shard behind."""
        if self._shard is not None:
            self._shard.close()
            self._shard = None
            with contextlib.suppress(OSError):
                self.shard_path(trainer.global_rank).unlink()

    # -- all ranks done: rank zero merges ------------------------------------------------------
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """After a successful `predict` on every rank, including one whose share of the
        inputs was empty (Lightning skips its predict loop and `on_predict_*` hooks)."""
        if stage != "predict":
            return
        if self._shard is not None:
            self._shard.close()
            self._shard = None
        trainer.strategy.barrier("CaptionWriter.merge")
        summary: dict[str, Any] = {}
        if trainer.is_global_zero:
            try:
                summary = self.merge(trainer.world_size)
            except OSError as e:
                summary = {"error": str(e)}
        summary = trainer.strategy.broadcast(summary, src=0)
        if "error" in summary:  # a user error (one line from the CLI), on every rank
            raise FileNotFoundError(summary["error"])
        self.captioned, self.failed = summary["captioned"], summary["failed"]

    def merge(self, world_size: int) -> dict[str, int]:
        """Merge the shards of ranks 0..world_size-1 into `out` (input order, each input once)
        and remove them; returns the totals."""
        shards = [self.shard_path(r) for r in range(world_size)]
        missing = [str(s) for s in shards if not s.exists()]
        if missing:
            raise FileNotFoundError(
                f"prediction shard(s) missing: {', '.join(missing)} (with several nodes, "
                "the output folder must be one that every node shares)")
        records: dict[int, dict[str, Any]] = {}
        failed: set[int] = set()
        for shard in shards:
            with open(shard, encoding="utf-8") as f:
                for line in f:
                    rec = json.loads(line)
                    if "error" in rec:
                        failed.add(rec["index"])
                    else:
                        records.setdefault(rec.pop("index"), rec)
        write_results_json([records[i] for i in sorted(records)], self.out)
        for shard in shards:
            shard.unlink()
        return {"captioned": len(records), "failed": len(failed)}
