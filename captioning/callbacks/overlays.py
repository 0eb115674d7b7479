"""`AttentionOverlayCallback` shows what the model looks at while it trains: every few validation
epochs it captions a fixed set of images with the module's own decoding path
(`CaptioningModule.generate`) and logs one attention strip per image (Xu et al. 2015, Fig. 2-3)
to every W&B logger, as images and as a table; without a W&B logger (or with `save_dir`) the
strips are written as PNG files.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from captioning.evaluation import caption_words
from captioning.viz import UPSAMPLE_MODES, caption_strips, render_strips, save_strip_png
from captioning.vocab import Vocabulary

log = logging.getLogger(__name__)

_UNSAFE = re.compile(r"[^A-Za-z0-9._-]+")


class AttentionOverlayCallback(L.Callback):
    """Log attention overlays of a fixed set of images every `every_n_epochs` validations.

    The images are the first `num_images` records of `split` (deterministic), loaded from their
    files with the evaluation transform, so this works with the feature cache too. Runs on rank
    zero only, on the module's device, under `torch.no_grad` and the validation precision
    context. Each strip is the image followed by one panel per generated word (at most
    `max_words`), with α_t upsampled (`upsample`: "bicubic", "bilinear" or "gaussian");
    hard-attention models also mark the sampled location (not in `test/predictions`, drawn from
    the test results, which keep α but not the locations).

    Logged to every `WandbLogger` of the trainer: `{split}/attention` (one `wandb.Image` per
    strip, captioned with the generated caption) and, when `log_table`, `{split}/attention_table`
    (columns image, caption, references, overlay). After a test, `test/predictions` holds the
    first `test_table_rows` test images: overlay strip, caption, references and the image's
    CIDEr-D (from the module's `test_results`). PNGs are written to
    `save_dir/epoch_XX/` when `save_dir` is set, and to `trainer.log_dir/overlays/epoch_XX/`
    when the trainer has no W&B logger.
    """

    def __init__(
        self,
        num_images: int = 8,
        every_n_epochs: int = 1,
        split: str = "val",
        upsample: str = "bicubic",
        max_words: int = 16,
        log_table: bool = True,
        save_dir: str | None = None,
        test_table_rows: int = 100,
    ) -> None:
        super().__init__()
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1, got {max_words}")
        if test_table_rows < 0:
            raise ValueError(f"test_table_rows must be >= 0, got {test_table_rows}")
        if upsample not in UPSAMPLE_MODES:
            raise ValueError(f"upsample must be one of {UPSAMPLE_MODES}, got {upsample!r}")
        self.num_images = num_images
        self.every_n_epochs = every_n_epochs
        self.split = split
        self.upsample = upsample
        self.max_words = max_words
        self.log_table = log_table
        self.save_dir = save_dir
        self.test_table_rows = test_table_rows
        self.validation_epochs = 0  # completed validation epochs (sanity checks excluded)
        self.last_captions: dict[Any, str] = {}  # image id -> caption of the last overlay run
        self.last_words: dict[Any, list[str]] = {}  # image id -> its panels' words (last run)
        self.last_paths: list[Path] = []  # PNG files written by the last overlay run
        self._inputs: tuple[Tensor, list[Any], list[list[str]]] | None = None
        self._fallback_root: str | None = None  # the run's log folder, when nothing else saves

    # -- lightning hooks -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"validation_epochs": self.validation_epochs}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.validation_epochs = int(state_dict.get("validation_epochs", 0))

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Load the fixed images up front, so that a bad file fails now, not after an epoch."""
        if stage in ("fit", "validate") and trainer.is_global_zero:
            self._load_inputs(trainer)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.sanity_checking:
            return
        self.validation_epochs += 1  # on every rank: the cadence stays in step
        if self.validation_epochs % self.every_n_epochs:
            return
        if self.save_dir is None and not _wandb_loggers(trainer):
            # trainer.log_dir is a collective under DDP: every rank must ask for it.
            self._fallback_root = trainer.log_dir or trainer.default_root_dir
        if not trainer.is_global_zero:
            return
        self.log_overlays(trainer, pl_module)

    def on_test_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """The predictions table (after the module's test epoch end has scored the captions)."""
        results = getattr(pl_module, "test_results", None)
        loggers = _wandb_loggers(trainer)
        if not (trainer.is_global_zero and loggers and self.test_table_rows and results
                and results.hypotheses):
            return
        import wandb

        dm = getattr(trainer, "datamodule", None)
        records = [r for r in dm.records("test") if r.image_id in results.hypotheses]
        records = records[: self.test_table_rows]
        strips = self._result_strips(dm, pl_module, results, records)
        rows = [[wandb.Image(strip), results.hypotheses[r.image_id],
                 "\n".join(results.references.get(r.image_id, [])),
                 results.cider.get(r.image_id)] for r, strip in zip(records, strips)]
        table = wandb.Table(columns=["overlay", "caption", "references", "CIDEr"], data=rows)
        for logger in loggers:
            logger.log_metrics({"test/predictions": table}, step=trainer.global_step)

    def _result_strips(self, dm: Any, pl_module: L.LightningModule, results: Any,
                       records: Sequence[Any]) -> list[Any]:
        """Each record's strip (uint8 HxWx3) from the α maps its test caption was decoded with."""
        from captioning.data.transforms import model_input

        transform = dm.image_transform(False)
        grid = pl_module.captioner.grid  # type: ignore[union-attr]
        out = []
        for r in records:
            words = results.words[r.image_id][: self.max_words]
            alphas = results.alphas[r.image_id][: len(words)].float()
            if alphas.shape[0] == 0:  # an empty caption: the image panel alone
                alphas = torch.zeros(1, grid[0] * grid[1])
            image = model_input(r.path, dm.image_size, transform=transform)[None]
            out.append(render_strips(image, alphas[None], grid, [words],
                                     upsample=self.upsample)[0].numpy())
        return out

    # -- work ------------------------------------------------------------------------------
    @rank_zero_only
    def log_overlays(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Decode the fixed images, render their strips and log / save them (rank zero)."""
        vocab = self._vocab(trainer, pl_module)
        if vocab is None:
            log.warning("AttentionOverlayCallback: no vocabulary on the module or the data "
                        "module; skipping the overlays")
            return
        images, image_ids, references = self._load_inputs(trainer)
        images = images.to(pl_module.device)
        was_training = pl_module.training
        pl_module.eval()
        try:
            with torch.no_grad(), self._precision_context(trainer):
                gen = pl_module.generate(images)  # type: ignore[operator]
                words, captions = caption_words(gen, vocab)
                words = [w[: self.max_words] for w in words]
                hard = pl_module.captioner.config.attention == "hard"  # type: ignore[union-attr]
                full, strips = caption_strips(
                    images, gen.alphas, pl_module.captioner.grid,  # type: ignore[union-attr]
                    words, points=gen.locations if hard else None, upsample=self.upsample)
        finally:
            pl_module.train(was_training)

        width = images.shape[-1]
        height = images.shape[-2]
        full_np = full.numpy()  # (N, H', W * (T_max + 1), 3): one size for the media list
        strips_np = [s.numpy().copy() for s in strips]  # each cut to its own caption
        self.last_captions = dict(zip(image_ids, captions))
        self.last_words = dict(zip(image_ids, words))
        epoch, step = trainer.current_epoch, trainer.global_step

        wandb_loggers = _wandb_loggers(trainer)
        for logger in wandb_loggers:
            self._log_wandb(logger, list(full_np), strips_np, height, width, captions, references,
                            step)

        self.last_paths = []
        folder = None
        if self.save_dir is not None:
            folder = Path(self.save_dir) / f"epoch_{epoch:02d}"
        elif not wandb_loggers:
            root = self._fallback_root or trainer.default_root_dir
            folder = Path(root) / "overlays" / f"epoch_{epoch:02d}"
        if folder is not None:
            for k, (image_id, strip) in enumerate(zip(image_ids, strips)):
                name = f"{k:02d}_{_UNSAFE.sub('_', str(image_id))}.png"
                path = save_strip_png(strip, folder / name)
                self.last_paths.append(path)
            log.info("wrote %d attention overlays to %s", len(self.last_paths), folder)

    def _log_wandb(self, logger: Any, full: Sequence[Any], strips: Sequence[Any], height: int,
                   width: int, captions: Sequence[str], references: Sequence[Sequence[str]],
                   step: int) -> None:
        """`full`: equal-size strips (W&B media lists need one size); `strips`: cut per caption."""
        import numpy as np
        import wandb

        key = f"{self.split}/attention"
        metrics: dict[str, Any] = {
            key: [wandb.Image(s, caption=c) for s, c in zip(full, captions)]}
        if self.log_table:
            rows = [[wandb.Image(np.ascontiguousarray(s[:height, :width])), c, "\n".join(refs),
                     wandb.Image(s, caption=c)]
                    for s, c, refs in zip(strips, captions, references)]
            metrics[f"{key}_table"] = wandb.Table(
                columns=["image", "caption", "references", "overlay"], data=rows)
        logger.log_metrics(metrics, step=step)  # one history row, x-axis trainer/global_step

    # -- helpers ---------------------------------------------------------------------------
    def _load_inputs(self, trainer: L.Trainer) -> tuple[Tensor, list[Any], list[list[str]]]:
        """(N, 3, S, S) eval-transformed images on the CPU, their ids and references (cached)."""
        if self._inputs is None:
            from captioning.data.transforms import model_input

            dm = getattr(trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "records") or not hasattr(dm, "image_transform"):
                raise RuntimeError("AttentionOverlayCallback needs a CaptionDataModule "
                                   "(trainer.datamodule with records() and image_transform())")
            records = dm.records(self.split)[: self.num_images]
            if not records:
                raise ValueError(f"AttentionOverlayCallback: the {self.split!r} split is empty")
            transform = dm.image_transform(False)
            images = torch.stack([model_input(r.path, dm.image_size, transform=transform)
                                  for r in records])  # as the model reads them
            self._inputs = (images, [r.image_id for r in records],
                            [list(r.captions) for r in records])
        return self._inputs

    @staticmethod
    def _vocab(trainer: L.Trainer, pl_module: L.LightningModule) -> Vocabulary | None:
        vocab = getattr(pl_module, "vocab", None)
        if vocab is None:
            vocab = getattr(getattr(trainer, "datamodule", None), "vocab", None)
        return vocab

    @staticmethod
    def _precision_context(trainer: L.Trainer) -> contextlib.AbstractContextManager[Any]:
        """The precision context validation steps run under (e.g. bf16 autocast)."""
        plugin = getattr(getattr(trainer, "strategy", None), "precision_plugin", None)
        if plugin is None or not hasattr(plugin, "val_step_context"):
            return contextlib.nullcontext()
        return plugin.val_step_context()


def _wandb_loggers(trainer: L.Trainer) -> list[Any]:
    from lightning.pytorch.loggers import WandbLogger

    return [lg for lg in getattr(trainer, "loggers", []) if isinstance(lg, WandbLogger)]
