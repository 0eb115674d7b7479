"""CaptioningModule, the thin LightningModule around a pure-torch Captioner: steps, epoch ends,
optimisers. Losses: `captioning.objectives`; decoding: `Captioner.generate`; metrics and results:
`captioning.evaluation`; checkpoint extras (the vocabulary too): `captioning.checkpoint`."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import torch
from torch import Tensor

from captioning import checkpoint as ckpt
from captioning import evaluation, rng_state
from captioning.callbacks.gumbel import GumbelTemperature
from captioning.data.carving import CARVING, CARVING_KEY, check_carving
from captioning.data.serving import attach_feature_cache
from captioning.distributed import rank_zero_result
from captioning.evaluation import EvalResults, compute_metrics, gather, to_results, write_results
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoding import Generation
from captioning.models.encoder import fingerprint
from captioning.models.fast_path import FastPathSetting, resolve_fast_path
from captioning.models.fixed_beam import FastBeamSetting
from captioning.objectives import ObjectiveKind, RewardForm, build_objective
from captioning.optim import StepGuard, batch_message, build_adam, poisoned_loss, says_non_finite
from captioning.scst import ScstConfig
from captioning.train_values import TrainValues
from captioning.vocab import Vocabulary


class CaptioningModule(L.LightningModule):
    """Trains a Show, Attend and Tell captioner with soft or hard attention.

    `advantage` names the hard-attention REINFORCE estimator (`captioning.objectives.ESTIMATORS`),
    `reward` its reward: `sum` over the caption's words (the paper) or `mean` (capgen.py).
    `objective: scst`: SCST fine-tuning (`scst`), from `init_from`'s weights (the CLI loads them).
    `spice`: SPICE too, in the test pass only (it needs the CoreNLP jars; else a warning says why).
    `fused_adam`: Adam's fused kernel; None: on CPU or CUDA, unless 16-mixed scales the loss.
    With it the non-finite check costs no host sync (`captioning.optim.StepGuard`).
    `fast_beam`: beam search over fixed shapes (`Captioner.use_fast_beam`; `auto`: on CUDA)."""

    def __init__(
        self,
        *,
        vocab_size: int = 0,
        net: CaptionerConfig = CaptionerConfig(),
        decode: DecodeConfig = DecodeConfig(),
        encoder_lr: float = 1e-4,
        decoder_lr: float = 4e-4,
        weight_decay: float = 0.0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        warmup_steps: int = 0,
        doubly_stochastic: float = 1.0,
        reward_scale: float = 0.1,
        entropy_weight: float = 0.002,
        baseline_momentum: float = 0.9,
        advantage: str = "sequence",
        reward: RewardForm = "sum",
        objective: ObjectiveKind = "cross_entropy",
        scst: ScstConfig = ScstConfig(),  # noqa: B008 (a frozen dataclass)
        init_from: str | None = None,
        compute_metrics: bool = True,
        spice: bool = False,
        results_dir: str | None = None,
        fast_path: FastPathSetting = "auto",
        fast_bucket: int = 8,
        fast_beam: FastBeamSetting = "auto",
        fused_adam: bool | None = None,
    ) -> None:
        super().__init__()
        net = CaptionerConfig.from_dict(net) if isinstance(net, dict) else net  # ckpt hparams
        decode = DecodeConfig.from_dict(decode) if isinstance(decode, dict) else decode
        scst = ScstConfig.from_dict(scst) if isinstance(scst, dict) else scst
        net = replace(net, vocab_size=vocab_size) if vocab_size else net
        self.save_hyperparameters(ignore=["net", "decode", "scst"])
        self.hparams.update(net=net.to_dict(), decode=decode.to_dict(), scst=scst.to_dict())
        self.decode, self.captioner = decode, Captioner(net)
        self.captioner.use_fast_beam(fast_beam)
        self.objective = build_objective(**{  # each objective takes its settings from these
            **self.hparams, "attention": net.attention, "hard_estimator": net.hard_estimator,
            "vocab_size": net.vocab_size, "scst": scst, "forbid_unk": decode.forbid_unk})
        self.vocab: Vocabulary | None = None
        self.val_results, self.test_results = EvalResults(), EvalResults()
        self._pending = EvalResults()
        self._cache_source: tuple[Any, str] | None = None  # (data module, encoder fingerprint)
        self._guard = StepGuard(self.named_parameters)  # non-finite losses and gradients
        self._train_values = TrainValues()  # logged on the steps that reach the loggers

    @property
    def net_config(self) -> CaptionerConfig:
        return self.captioner.config

    # -- set-up and checkpoints --------------------------------------------------------------
    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(dm, "vocab", None)
        if vocab is not None and len(vocab) != self.net_config.vocab_size:
            raise ValueError(f"vocabulary has {len(vocab)} words but the model was built for "
                             f"{self.net_config.vocab_size}; rebuild the model or use its vocab")
        self.vocab = self.vocab if vocab is None else vocab
        self.objective.attach(dm)  # SCST's reward reads the training references
        if getattr(dm, "feature_cache", False) and not self.net_config.finetune_encoder:
            self._attach_feature_cache(dm)
        if self.captioner.decoder.fast_path == "off":  # once: a compiled pass keeps its graphs
            t = self._trainer  # CUDA graphs do not keep gradients summed over several batches
            mode = resolve_fast_path(self.hparams.fast_path, t.strategy.root_device if t else
                                     self.device, self.net_config.attention,
                                     accumulate=t.accumulate_grad_batches if t else 1)
            self.captioner.decoder.use_fast_path(mode, bucket=self.hparams.fast_bucket)

    def _attach_feature_cache(self, dm: Any) -> None:
        """Frozen encoder: the data module serves cached annotation grids; the CNN never runs."""
        key = self.captioner.feature_cache_key()
        attach_feature_cache(dm, self.captioner.encoder, key, strategy=self.trainer.strategy,
                             stage=self.trainer.state.fn)
        self._cache_source = (dm, key["weights"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._guard.flush()  # never save weights after an unchecked step
        if self.vocab is not None:
            checkpoint[ckpt.CHECKPOINT_VOCAB_KEY] = self.vocab.to_dict()
        checkpoint[ckpt.CHECKPOINT_CONFIG_KEY] = self.net_config.to_dict()
        checkpoint[ckpt.CHECKPOINT_RNG_KEY] = rng_state.saved_rng_states()  # each DDP rank's
        checkpoint[CARVING_KEY] = CARVING

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        state, trainer = self.state_dict(), getattr(self, "_trainer", None)
        ckpt.upgrade(checkpoint, own_keys=set(state))
        ckpt.check_fits(checkpoint, state=state, config=self.net_config, vocab=self.vocab,
                        strict=getattr(self, "strict_loading", True))
        check_carving(checkpoint, getattr(trainer, "datamodule", None))  # test: no train image
        if ckpt.CHECKPOINT_VOCAB_KEY in checkpoint:
            self.vocab = Vocabulary.from_dict(checkpoint[ckpt.CHECKPOINT_VOCAB_KEY])
        self._refresh_feature_cache(checkpoint)
        # Resuming a fit: continue the random streams (dropout, hard-attention sampling, loader
        # seeds) where the checkpoint left them, before the fit loop makes its first iterator.
        rng = checkpoint.get(ckpt.CHECKPOINT_RNG_KEY)
        if rng is not None and trainer is not None and trainer.state.fn == "fit":
            rng_state.restore_rng_states(rng, rank=trainer.global_rank, world=trainer.world_size)

    def _refresh_feature_cache(self, checkpoint: dict[str, Any]) -> None:
        """Setup built the feature cache with the encoder as constructed; when the checkpoint
        being restored holds other encoder weights, load them now and serve their features."""
        state = checkpoint.get("state_dict")
        if self._cache_source is None or not isinstance(state, dict):
            return
        (dm, weights), prefix = self._cache_source, "captioner.encoder."
        encoder = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not encoder or fingerprint(encoder) == weights:
            return
        self.captioner.encoder.load_state_dict(encoder)  # the full load follows, same values
        self._attach_feature_cache(dm)

    def on_fit_start(self) -> None:
        """Report what the data module skipped as bad input (`data/skipped_*`) to every logger."""
        self._guard = StepGuard(self.named_parameters)  # nothing left from a failed fit
        skipped = getattr(getattr(self.trainer, "datamodule", None), "skipped", None)
        if isinstance(skipped, dict) and self.trainer.is_global_zero:
            metrics = {f"data/skipped_{k}": float(v) for k, v in skipped.items()}
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)

    # -- training ----------------------------------------------------------------------------
    def configure_callbacks(self) -> list[L.Callback]:  # τ of Gumbel-softmax hard attention
        return [GumbelTemperature()] if self.net_config.hard_estimator == "gumbel" else []

    def losses(self, batch: Any, features: Tensor | None = None) -> dict[str, Tensor]:
        """The objective's named loss parts for a batch (`loss` is optimised)."""
        if features is None:  # cached float16 grids stay so (`Captioner.encode`)
            features = self.captioner.encode(batch.images, keep_half=True)
        return self.objective(self.captioner, features, batch)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        if self.captioner.decoder.fast_path == "graphs":  # last step's graph outputs are free
            torch.compiler.cudagraph_mark_step_begin()
        where = {"step": self.global_step, "epoch": self.current_epoch}
        try:
            parts = self.losses(batch)
        except RuntimeError as e:  # e.g. hard attention sampling from NaN attention weights
            if not says_non_finite(e):
                raise
            what = f"values in the forward pass ({e})"  # the cause, on every rank
            if self.trainer.world_size < 2:
                raise FloatingPointError(batch_message(what, batch, batch_idx, **where)) from e
            self.objective.stand_in(self.captioner)  # the collectives its forward had left
            loss = poisoned_loss(self.parameters())  # DDP: the other ranks stop with this one
            self._guard.add_loss(loss, batch, batch_idx, what=what, **where)
            return loss
        loss = parts["loss"]
        self._guard.add_loss(loss, batch, batch_idx, **where)  # checked before the optimiser
        self._train_values.offer(self, self._trainer, parts, batch.captions.size(0))
        return loss

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self._train_values.on_batch_end(self)  # a step that stops the run is logged

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self._guard.check(optimizer, step=self.global_step, scaled=self._scaled())

    def on_train_epoch_end(self) -> None:  # a deferred check's last step (fused Adam)
        self._guard.flush()

    def on_validation_start(self) -> None:
        if self.trainer.state.fn == "fit":  # not a later validate() after a failed fit
            self._guard.flush()

    def configure_gradient_clipping(self, optimizer: torch.optim.Optimizer,
                                    gradient_clip_val: float | None = None,
                                    gradient_clip_algorithm: str | None = None) -> None:
        """Clipping by norm reuses the norm the step's check computed (`StepGuard.clip`)."""
        self._guard.clip(optimizer, gradient_clip_val, gradient_clip_algorithm or "norm",
                         scaled=self._scaled())

    def _scaled(self) -> bool:
        """A GradScaler (16-mixed) scales the loss and owns the gradients' finiteness."""
        return getattr(self.trainer.precision_plugin, "scaler", None) is not None

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        enc = [p for p in self.captioner.encoder.parameters() if p.requires_grad]
        groups = [{"params": list(self.captioner.decoder.parameters()), "lr": hp.decoder_lr}]
        groups += [{"params": enc, "lr": hp.encoder_lr}] if enc else []
        fused = hp.fused_adam if hp.fused_adam is not None else (  # unless a GradScaler
            self.device.type in ("cuda", "cpu") and not self._scaled())  # (16-mixed) unscales
        scheduled = hp.lr_schedule != "constant" or hp.warmup_steps > 0
        steps = int(self.trainer.estimated_stepping_batches) if scheduled else 0
        return build_adam(groups, weight_decay=hp.weight_decay, fused=fused,
                          schedule=hp.lr_schedule, warmup_steps=hp.warmup_steps, total_steps=steps)

    # -- evaluation --------------------------------------------------------------------------
    def generate(self, images: Tensor) -> Generation:
        """One caption per image by `decode` (the first of `num_captions`): val, test, overlays."""
        return self.captioner.generate(images, self.decode).first_per_image()

    def _eval_step(self, batch: Any, prefix: str) -> None:
        features = self.captioner.encode(batch.images)
        parts, bs = self.losses(batch, features), batch.captions.size(0)
        for name in [n for n in ("loss", "nll_per_word", "attn_entropy") if n in parts]:
            self.log(f"{prefix}/{name}", parts[name], batch_size=bs, sync_dist=True,
                     prog_bar=name == "loss")
        if not self.hparams.compute_metrics or self.vocab is None:
            return
        gen = self.generate(features)
        self._pending.merge(to_results(gen, self.vocab, batch.image_ids, batch.references))

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def predict_step(self, batch: Any, batch_idx: int) -> dict[str, Any]:
        """A `captioning.data.predict` batch's captions (`evaluation.predictions`)."""
        gen = self.captioner.generate(batch.images, self.decode)
        return {"indices": batch.indices, "paths": batch.paths,
                **evaluation.predictions(gen, self.vocab)}

    def on_validation_epoch_start(self) -> None:
        self._pending = EvalResults()

    on_test_epoch_start = on_validation_epoch_start

    def _finish_eval(self, prefix: str) -> EvalResults:
        results, self._pending = gather(self._pending), EvalResults()
        if not results.hypotheses or self.trainer.sanity_checking:
            return results

        def score() -> dict[str, float]:  # on rank zero; its scores, or its error, on every rank
            dm = getattr(self.trainer, "datamodule", None)
            metrics = compute_metrics(results, grid=self.captioner.grid,
                                      grounding=getattr(dm, "grounding", None),
                                      image_size=getattr(dm, "image_size", None),
                                      spice=self.hparams.spice and prefix == "test")
            return {**metrics, "images": float(len(results.hypotheses))}  # scored ones
        strategy = self.trainer.strategy
        results.metrics = metrics = rank_zero_result(strategy, score, what="score the captions")
        for name, value in metrics.items():
            self.log(f"{prefix}/{name}", value, rank_zero_only=False, sync_dist=False)
        return results

    def on_validation_epoch_end(self) -> None:
        if (results := self._finish_eval("val")).metrics:
            self.val_results = results

    def on_test_start(self) -> None:  # a killed test never leaves the last run's results
        evaluation.set_aside_results(self.results_folder(), "test", self.trainer.is_global_zero)

    def on_test_epoch_end(self) -> None:
        self.test_results = self._finish_eval("test")
        folder = self.results_folder()  # on every rank: trainer.log_dir is a DDP broadcast
        if self.trainer.is_global_zero and self.test_results.hypotheses:
            write_results(self.test_results, "test", folder)

    def results_folder(self) -> Path:
        """`results_dir`, else the trainer's log dir (a collective under DDP)."""
        return Path(self.hparams.results_dir or self.trainer.log_dir
                    or self.trainer.default_root_dir)
