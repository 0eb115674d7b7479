"""Training callbacks.

`AttentionOverlayCallback` shows what the model looks at while it trains: every few validation
epochs it captions a fixed set of images with the module's own decoding path
(`CaptioningModule.generate`) and logs one attention strip per image (Xu et al. 2015, Fig. 2-3)
to every W&B logger, as images and as a table; without a W&B logger (or with `save_dir`) the
strips are written as PNG files.

`CheckpointOnInterrupt` makes Ctrl-C and SIGTERM stop training cleanly and leave `last.ckpt`
where `--ckpt_path last` finds it.
"""

from __future__ import annotations

import contextlib
import logging
import re
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import torch
from lightning.pytorch.utilities import rank_zero_only
from torch import Tensor

from captioning.viz import UPSAMPLE_MODES, render_strips, save_strip_png
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
    hard-attention models also mark the sampled location.

    Logged to every `WandbLogger` of the trainer: `{split}/attention` (one `wandb.Image` per
    strip, captioned with the generated caption) and, when `log_table`, `{split}/attention_table`
    (columns image, caption, references, overlay). PNGs are written to
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
    ) -> None:
        super().__init__()
        if num_images < 1:
            raise ValueError(f"num_images must be >= 1, got {num_images}")
        if every_n_epochs < 1:
            raise ValueError(f"every_n_epochs must be >= 1, got {every_n_epochs}")
        if max_words < 1:
            raise ValueError(f"max_words must be >= 1, got {max_words}")
        if upsample not in UPSAMPLE_MODES:
            raise ValueError(f"upsample must be one of {UPSAMPLE_MODES}, got {upsample!r}")
        self.num_images = num_images
        self.every_n_epochs = every_n_epochs
        self.split = split
        self.upsample = upsample
        self.max_words = max_words
        self.log_table = log_table
        self.save_dir = save_dir
        self.validation_epochs = 0  # completed validation epochs (sanity checks excluded)
        self.last_captions: dict[Any, str] = {}  # image id -> caption of the last overlay run
        self.last_words: dict[Any, list[str]] = {}  # image id -> its panels' words (last run)
        self.last_paths: list[Path] = []  # PNG files written by the last overlay run
        self._inputs: tuple[Tensor, list[Any], list[list[str]]] | None = None

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
                words, captions = self._decode(vocab, gen.tokens, gen.lengths)
                hard = pl_module.captioner.config.attention == "hard"  # type: ignore[union-attr]
                t = max(1, max(len(w) for w in words))
                strips = render_strips(
                    images, gen.alphas[:, :t].float(), pl_module.captioner.grid,  # type: ignore[union-attr]
                    words, points=gen.locations[:, :t] if hard else None,
                    upsample=self.upsample)
        finally:
            pl_module.train(was_training)

        width = images.shape[-1]
        height = images.shape[-2]
        full_np = strips.cpu().numpy()  # (N, H', W * (T_max + 1), 3): one size for the media list
        strips_np = [full_np[i, :, : (len(words[i]) + 1) * width].copy()
                     for i in range(len(words))]  # each strip cut to its own caption
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
            root = getattr(self, "_fallback_root", None) or trainer.default_root_dir
            folder = Path(root) / "overlays" / f"epoch_{epoch:02d}"
        if folder is not None:
            for k, (image_id, strip) in enumerate(zip(image_ids, strips)):
                name = f"{k:02d}_{_UNSAFE.sub('_', str(image_id))}.png"
                path = save_strip_png(strip[:, : (len(words[k]) + 1) * width], folder / name)
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
    def _decode(self, vocab: Vocabulary, tokens: Tensor,
                lengths: Tensor) -> tuple[list[list[str]], list[str]]:
        """Per caption: the words of its first `max_words` steps, position-aligned with α
        (a special token such as <unk> keeps its panel), and the caption text as
        `Vocabulary.decode` gives it (what the validation metrics score)."""
        words, captions = [], []
        for row, n in zip(tokens.tolist(), lengths.tolist()):
            steps = []
            for i in row[:n]:
                if i == vocab.end_id:
                    break
                steps.append(vocab.itos[i])
            words.append(steps[: self.max_words])
            captions.append(" ".join(vocab.decode(row[:n])))
        return words, captions

    def _load_inputs(self, trainer: L.Trainer) -> tuple[Tensor, list[Any], list[list[str]]]:
        """(N, 3, S, S) eval-transformed images on the CPU, their ids and references (cached)."""
        if self._inputs is None:
            from captioning.data.images import load_image

            dm = getattr(trainer, "datamodule", None)
            if dm is None or not hasattr(dm, "records") or not hasattr(dm, "image_transform"):
                raise RuntimeError("AttentionOverlayCallback needs a CaptionDataModule "
                                   "(trainer.datamodule with records() and image_transform())")
            records = dm.records(self.split)[: self.num_images]
            if not records:
                raise ValueError(f"AttentionOverlayCallback: the {self.split!r} split is empty")
            transform = dm.image_transform(False)
            images = torch.stack([transform(load_image(r.path)) for r in records])
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

    Resuming from an epoch boundary reproduces an uninterrupted run exactly (the data order is
    seeded per epoch and `CaptioningModule` stores the RNG states); a checkpoint taken
    mid-epoch resumes with a fresh pass over the data for the rest of that epoch.
    """

    def __init__(self, graceful_sigint: bool = True) -> None:
        super().__init__()
        self.graceful_sigint = graceful_sigint
        self.saved_path: Path | None = None  # the checkpoint written by the last interruption
        self._training = False
        self._stop_requested = False
        self._trainer: L.Trainer | None = None
        self._previous_handler: Any = None
        self._epoch_start = False  # saving an interruption that came before the epoch's batches

    # -- lightning hooks -------------------------------------------------------------------
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Lightning installs its SIGTERM handler just before this hook (and restores every
        # handler at teardown); installing ours here keeps that restore correct.
        self._training, self._stop_requested, self._trainer = True, False, trainer
        if self.graceful_sigint and threading.current_thread() is threading.main_thread():
            self._previous_handler = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._on_sigint)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._training = False
        self._restore_sigint()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._restore_sigint()
        self._trainer = None

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule,
                     exception: BaseException) -> None:
        self._restore_sigint()
        from lightning.pytorch.utilities.exceptions import SIGTERMException

        if isinstance(exception, KeyboardInterrupt):
            cause = "KeyboardInterrupt"
        elif isinstance(exception, SIGTERMException):
            cause = "SIGINT" if self._stop_requested else "SIGTERM"
        else:
            return
        with contextlib.suppress(AttributeError):
            exception.interrupt = cause  # type: ignore[attr-defined]
        if not self._training or trainer.state.fn != "fit":
            log.warning("%s before training started: no checkpoint saved", cause)
            return
        self._training = False
        existing = _current_last_checkpoint(trainer)
        path = existing or self.save(trainer)
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
        try:
            trainer.save_checkpoint(path)
        finally:
            self._epoch_start = False
        self.saved_path = path
        return path

    def _on_sigint(self, signum: int, frame: Any) -> None:
        trainer = self._trainer
        connector = getattr(trainer, "_signal_connector", None)
        if self._stop_requested or connector is None or not hasattr(connector, "received_sigterm"):
            raise KeyboardInterrupt
        self._stop_requested = True
        # Lightning's own graceful-stop flag: the loops raise SIGTERMException at the next
        # batch (or epoch) boundary, after the step's bookkeeping is complete.
        connector.received_sigterm = True
        log.warning("Ctrl-C: stopping after the current batch and saving a checkpoint "
                    "(press Ctrl-C again to stop at once)")

    def _restore_sigint(self) -> None:
        if self._previous_handler is not None and \
                threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, self._previous_handler)
        self._previous_handler = None


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


def _zero_current(state: dict[str, Any]) -> None:
    """Zero every per-epoch ("current") progress counter in a loop-progress state dict."""
    for key, value in state.items():
        if key == "current" and isinstance(value, dict):
            state[key] = {k: 0 for k in value}
        elif isinstance(value, dict):
            _zero_current(value)


def _current_last_checkpoint(trainer: L.Trainer) -> Path | None:
    """The last checkpoint a `ModelCheckpoint` already wrote at the current step, if any."""
    for cb in _model_checkpoints(trainer):
        path = Path(cb.last_model_path) if cb.last_model_path else None
        if (cb.save_last and path is not None and path.is_file()
                and getattr(cb, "_last_global_step_saved", None) == trainer.global_step):
            return path
    return None


def _model_checkpoints(trainer: L.Trainer) -> list[Any]:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [cb for cb in getattr(trainer, "checkpoint_callbacks", [])
            if isinstance(cb, ModelCheckpoint)]


def last_checkpoint_path(trainer: L.Trainer) -> Path:
    """Where `ckpt_path="last"` looks: the first `ModelCheckpoint`'s last checkpoint
    (`dirpath/last.ckpt`); `default_root_dir/checkpoints/last.ckpt` without one."""
    for cb in _model_checkpoints(trainer):
        if cb.dirpath:
            name = f"{cb.CHECKPOINT_NAME_LAST}{cb.FILE_EXTENSION}"
            if "{" in name:  # a formatted last name ("{epoch}-last"): keep the current file
                return Path(cb.last_model_path or Path(cb.dirpath) / "last.ckpt")
            return Path(cb.dirpath) / name
    return Path(trainer.default_root_dir) / "checkpoints" / "last.ckpt"
