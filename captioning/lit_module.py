"""CaptioningModule: the thin LightningModule around a pure-torch Captioner.

It owns the losses, the optimiser groups, decoding for evaluation, metrics and logging.
It holds no data: the vocabulary and boxes come from the trainer's data module, and the
vocabulary is stored in every checkpoint so that a checkpoint alone can caption.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

import lightning.pytorch as L
import torch
from torch import Tensor

from captioning.decoding import Generation
from captioning.losses import (
    MovingAverageBaseline,
    TokenBaseline,
    doubly_stochastic_penalty,
    entropy_bonus,
    reinforce_loss,
    reward_to_go,
    target_mask,
    word_log_likelihoods,
)
from captioning.models.captioner import Captioner, CaptionerConfig, Strategy
from captioning.vocab import Vocabulary

log = logging.getLogger(__name__)

CHECKPOINT_VOCAB_KEY = "captioning_vocab"
CHECKPOINT_CONFIG_KEY = "captioning_model_config"
CHECKPOINT_RNG_KEY = "captioning_rng_states"


@dataclass
class EvalResults:
    """Decoded captions of one evaluation pass, keyed by image id."""

    hypotheses: dict[Any, str] = field(default_factory=dict)
    references: dict[Any, list[str]] = field(default_factory=dict)
    words: dict[Any, list[str]] = field(default_factory=dict)
    alphas: dict[Any, Tensor] = field(default_factory=dict)  # (T, L) on the CPU
    scores: dict[Any, float] = field(default_factory=dict)
    metrics: dict[str, float] = field(default_factory=dict)

    def merge(self, other: EvalResults) -> None:
        for name in ("hypotheses", "references", "words", "alphas", "scores"):
            getattr(self, name).update(getattr(other, name))


class CaptioningModule(L.LightningModule):
    """Trains a Show, Attend and Tell captioner with soft or hard attention."""

    def __init__(
        self,
        *,
        vocab_size: int = 0,
        net: CaptionerConfig = CaptionerConfig(),
        encoder_lr: float = 1e-4,
        decoder_lr: float = 4e-4,
        weight_decay: float = 0.0,
        lr_schedule: Literal["constant", "cosine"] = "constant",
        warmup_steps: int = 0,
        doubly_stochastic: float = 1.0,
        reward_scale: float = 0.1,
        entropy_weight: float = 0.002,
        baseline_momentum: float = 0.9,
        advantage: Literal["sequence", "token", "expected"] = "sequence",
        eval_strategy: Strategy = "beam",
        beam_size: int = 3,
        max_len: int = 20,
        length_penalty: float = 0.0,
        forbid_unk: bool = False,
        compute_metrics: bool = True,
        results_dir: str | None = None,
        compile: bool = False,
    ) -> None:
        super().__init__()
        if isinstance(net, dict):  # from a checkpoint's plain-data hyperparameters
            net = CaptionerConfig.from_dict(net)
        if vocab_size:
            net = replace(net, vocab_size=vocab_size)
        self.save_hyperparameters(ignore=["net"])
        self.hparams["net"] = net.to_dict()
        self.captioner = Captioner(net)
        if advantage not in ("sequence", "token", "expected"):
            raise ValueError(
                f"advantage must be 'sequence', 'token' or 'expected', got {advantage!r}")
        self.baseline = MovingAverageBaseline(momentum=baseline_momentum)
        if advantage == "token":
            self.token_baseline = TokenBaseline(vocab_size=net.vocab_size,
                                                momentum=baseline_momentum)
        self.vocab: Vocabulary | None = None
        self.val_results = EvalResults()
        self.test_results = EvalResults()
        self._pending = EvalResults()
        self._compiled = False

    # -- plumbing --------------------------------------------------------------------------
    @property
    def net_config(self) -> CaptionerConfig:
        return self.captioner.config

    @property
    def hard(self) -> bool:
        return self.net_config.attention == "hard"

    def setup(self, stage: str) -> None:
        dm = getattr(self.trainer, "datamodule", None) if self._trainer is not None else None
        vocab = getattr(dm, "vocab", None)
        if vocab is not None:
            if len(vocab) != self.net_config.vocab_size:
                raise ValueError(
                    f"vocabulary has {len(vocab)} words but the model was built for "
                    f"{self.net_config.vocab_size}; rebuild the model or use the matching vocab")
            self.vocab = vocab
        if (dm is not None and getattr(dm, "feature_cache", False)
                and hasattr(dm, "use_encoder_cache") and not self.net_config.finetune_encoder):
            from lightning.pytorch.utilities.seed import isolate_rng

            with isolate_rng():  # building the cache must not shift the training RNG streams
                self._attach_feature_cache(dm)
        if self.hparams.compile and not self._compiled:
            self.compile_decoder()

    def compile_decoder(self) -> None:
        """`torch.compile` the decoder's per-step cell (attention + gate + LSTM), in place.

        Dynamic shapes: the active batch shrinks step by step, which must not recompile.
        Off by default (`compile: false`): see docs/benchmarks.md for when it pays.
        """
        dec = self.captioner.decoder
        dec._advance = torch.compile(dec._advance, dynamic=True)  # type: ignore[method-assign]
        self._compiled = True

    def feature_cache_key(self) -> dict[str, Any]:
        """What the cached annotation grids depend on besides the images and input size."""
        cfg = self.net_config
        return {"backbone": cfg.backbone, "grid_size": cfg.grid_size,
                "channels_last": cfg.channels_last,
                "weights": encoder_fingerprint(self.captioner.encoder)}

    def _attach_feature_cache(self, dm: Any) -> None:
        """Frozen encoder: the data module serves cached annotation grids, so training never
        runs the CNN. Rank zero builds the cache; the other ranks then open it."""
        key = self.feature_cache_key()
        strategy = self.trainer.strategy
        if self.trainer.is_global_zero:
            dm.use_encoder_cache(self.captioner.encoder, key, device=strategy.root_device)
        strategy.barrier("feature-cache")
        if not self.trainer.is_global_zero:
            dm.use_encoder_cache(self.captioner.encoder, key, device=strategy.root_device)
        self._cache_source = (dm, key["weights"])

    def _refresh_feature_cache(self, checkpoint: dict[str, Any]) -> None:
        """Setup built the feature cache with the encoder as constructed; when the checkpoint
        being restored holds other encoder weights, load them now and serve their features."""
        dm, weights = getattr(self, "_cache_source", (None, None))
        state = checkpoint.get("state_dict")
        if dm is None or not isinstance(state, dict):
            return
        prefix = "captioner.encoder."
        encoder = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        if not encoder or encoder_fingerprint(encoder) == weights:
            return
        self.captioner.encoder.load_state_dict(encoder)  # the full load follows, same values
        from lightning.pytorch.utilities.seed import isolate_rng

        with isolate_rng():
            self._attach_feature_cache(dm)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.vocab is not None:
            checkpoint[CHECKPOINT_VOCAB_KEY] = self.vocab.to_dict()
        checkpoint[CHECKPOINT_CONFIG_KEY] = self.net_config.to_dict()
        checkpoint[CHECKPOINT_RNG_KEY] = rng_states()

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self._check_checkpoint_fits(checkpoint)
        if CHECKPOINT_VOCAB_KEY in checkpoint:
            self.vocab = Vocabulary.from_dict(checkpoint[CHECKPOINT_VOCAB_KEY])
        self._refresh_feature_cache(checkpoint)
        # Resuming a fit: continue the random streams (dropout, hard-attention sampling, data
        # loader seeds) where the checkpoint left them, so that the resumed run matches an
        # uninterrupted one. Restored here, before the fit loop creates its first iterator.
        trainer = getattr(self, "_trainer", None)
        rng = checkpoint.get(CHECKPOINT_RNG_KEY)
        if rng is not None and trainer is not None and trainer.state.fn == "fit":
            set_rng_states(rng)

    def _check_checkpoint_fits(self, checkpoint: dict[str, Any]) -> None:
        """Refuse, with the differences spelled out, a checkpoint whose vocabulary is not the
        data's or whose weights do not fit this model (instead of a size-mismatch traceback)."""
        from captioning.checkpoint import CheckpointError

        if CHECKPOINT_VOCAB_KEY in checkpoint and self.vocab is not None:
            saved = Vocabulary.from_dict(checkpoint[CHECKPOINT_VOCAB_KEY])
            if saved != self.vocab:
                raise CheckpointError(
                    f"the checkpoint's vocabulary ({len(saved)} words) is not the data's "
                    f"({len(self.vocab)} words); resume or evaluate with the vocabulary the "
                    "model was trained with (data.vocab_path)")
        state = checkpoint.get("state_dict")
        if not isinstance(state, dict):
            return
        own = self.state_dict()
        problems = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(own[k].shape)}"
                    for k, v in state.items() if k in own and hasattr(v, "shape")
                    and tuple(v.shape) != tuple(own[k].shape)]
        if getattr(self, "strict_loading", True):
            problems += [f"{k}: missing from the checkpoint" for k in own if k not in state]
            problems += [f"{k}: not in this model" for k in state if k not in own]
        if not problems:
            return
        raw = checkpoint.get(CHECKPOINT_CONFIG_KEY) or \
            (checkpoint.get("hyper_parameters") or {}).get("net")
        if isinstance(raw, dict):
            diff = [f"{k}={raw[k]!r} (this model {v!r})"
                    for k, v in self.net_config.to_dict().items() if k in raw and raw[k] != v]
            config = "; checkpoint model config " + (", ".join(diff) if diff else "matches")
        else:
            config = "; the checkpoint has no captioning model config"
        raise CheckpointError(
            f"the checkpoint's weights do not fit this model ({len(problems)} tensors, first: "
            f"{'; '.join(problems[:3])}){config}")

    def on_fit_start(self) -> None:
        """Report what the data module skipped as bad input (`data/skipped_*`) to every logger."""
        skipped = getattr(getattr(self.trainer, "datamodule", None), "skipped", None)
        if isinstance(skipped, dict) and self.trainer.is_global_zero:
            metrics = {f"data/skipped_{k}": float(v) for k, v in skipped.items()}
            for logger in self.loggers:
                logger.log_metrics(metrics, step=self.global_step)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Cached grids travel as float16 (half the bytes); compute starts from float32."""
        images = getattr(batch, "images", None)
        if isinstance(images, Tensor) and images.dim() == 3 and images.dtype == torch.float16:
            batch.images = images.float()
        return batch

    # -- training --------------------------------------------------------------------------
    def _losses(self, batch: Any, features: Tensor | None = None) -> dict[str, Tensor]:
        if features is None:
            features = self.captioner.encode(batch.images)
        out = self.captioner.decoder(features, batch.captions, batch.lengths)
        word_ll, mask = _caption_word_ll(out.logits, batch.captions, batch.lengths)  # (B, T)
        loglik = word_ll.sum(dim=1)  # (B,) log p(y | s̃, a)
        nll = -loglik.mean()
        penalty = doubly_stochastic_penalty(out.alphas, mask)
        parts = {
            "nll": nll,
            "nll_per_word": -loglik.sum() / mask.sum().clamp_min(1),
            "doubly_stochastic": penalty,
        }
        loss = nll + self.hparams.doubly_stochastic * penalty
        if out.attn_log_probs is not None and out.attn_entropy is not None:
            # Hard attention (§4.1): REINFORCE with a moving-average baseline plus entropy.
            sampled = out.sampled
            reward, base = self._reward_and_baseline(word_ll, mask, features, batch, sampled)
            rl = reinforce_loss(reward, out.attn_log_probs, mask, base, sampled=sampled)
            entropy = entropy_bonus(out.attn_entropy, mask)
            loss = loss + self.hparams.reward_scale * rl - self.hparams.entropy_weight * entropy
            parts.update(reinforce=rl, attn_entropy=entropy / mask.sum(1).float().mean())
            if sampled is not None and bool(sampled.any()):
                # the whole caption's advantage (step 0 of a reward-to-go)
                parts["advantage"] = (reward - base).reshape(len(reward), -1)[sampled, 0].mean()
                reward = loglik[sampled]
                parts["reward"] = reward.mean()
                if bool(torch.isfinite(parts["reward"])):  # a NaN step must not poison b
                    self.baseline.update(reward)
            parts["baseline"] = self.baseline.value.clone()
        parts["loss"] = loss
        return parts

    def _reward_and_baseline(self, word_ll: Tensor, mask: Tensor, features: Tensor, batch: Any,
                             sampled: Tensor | None) -> tuple[Tensor, Tensor]:
        """REINFORCE reward and baseline for the configured `advantage` (§4.1 and variants).

        * sequence (the paper): R = log p(y|s̃,a) for every step, b the moving average;
        * token: R_t = Σ_{t'≥t} log p(y_t'|...), the reward-to-go (α_t cannot change earlier
          words), against the same sum of per-word moving averages b[y_t'];
        * expected: the reward-to-go against that of the same caption decoded with the
          expected context (a per-caption baseline, one extra forward pass without gradient).

        Every baseline is independent of the sampled locations, so each estimator is unbiased.
        """
        kind = self.hparams.advantage
        if kind == "sequence":
            return word_ll.sum(dim=1), self.baseline.value
        reward = reward_to_go(word_ll, mask)
        if kind == "token":
            targets = batch.captions[:, 1 : mask.size(1) + 1]
            base = reward_to_go(self.token_baseline(targets), mask)
            used = mask if sampled is None else mask & sampled.unsqueeze(1)
            self.token_baseline.update(word_ll, targets, used)
            return reward, base
        ref = self._expected_word_ll(features, batch, sampled, mask.size(1))
        return reward, reward_to_go(ref, mask)

    @torch.no_grad()
    def _expected_word_ll(self, features: Tensor, batch: Any, rows: Tensor | None,
                          steps: int) -> Tensor:
        """(B, steps) word log-likelihoods of `rows` (all if None) with the expected context."""
        B = batch.captions.size(0)
        idx = torch.arange(B, device=features.device) if rows is None else rows.nonzero()[:, 0]
        ll = features.new_zeros(B, steps, dtype=torch.float32)
        if idx.numel() == 0:
            return ll
        caps, lengths = batch.captions[idx], batch.lengths[idx]
        ref = self.captioner.decoder(features[idx], caps, lengths, rule="expected")
        ref_ll, _ = _caption_word_ll(ref.logits, caps, lengths)
        ll[idx, : ref_ll.size(1)] = ref_ll
        return ll

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        try:
            parts = self._losses(batch)
        except RuntimeError as e:  # e.g. hard attention sampling from NaN attention weights
            if "nan" not in str(e).lower() and "inf" not in str(e).lower():
                raise
            raise FloatingPointError(self._non_finite("values in the forward pass", batch,
                                                      batch_idx)) from e
        loss = parts["loss"]
        if not torch.isfinite(loss):
            raise FloatingPointError(self._non_finite(f"training loss {loss.item()}", batch,
                                                      batch_idx))
        bs = batch.captions.size(0)
        self.log_dict({f"train/{k}": v.detach() for k, v in parts.items()}, batch_size=bs,
                      prog_bar=False)
        self.log("train_loss", loss.detach(), batch_size=bs, prog_bar=True, logger=False)
        return loss

    def _non_finite(self, what: str, batch: Any, batch_idx: int) -> str:
        """The message for a non-finite loss: the step, and the images whose inputs are bad."""
        msg = (f"non-finite {what} at global step {self.global_step} (epoch "
               f"{self.current_epoch}, batch {batch_idx}); stopping before the weights are "
               "updated")
        images = getattr(batch, "images", None)
        if isinstance(images, Tensor) and images.is_floating_point():
            bad = (~torch.isfinite(images.flatten(1))).any(1).nonzero().flatten().tolist()
            if bad:
                ids = [batch.image_ids[i] for i in bad[:5]] if getattr(batch, "image_ids", None) \
                    else bad[:5]
                msg += f"; non-finite inputs for image(s) {ids}"
        return msg

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        grads = [p.grad for p in self.parameters() if p.grad is not None]
        if grads:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g.detach().float()) for g in grads]))
            if not torch.isfinite(norm):
                first = next((n for n, p in self.named_parameters() if p.grad is not None
                              and not bool(torch.isfinite(p.grad).all())), "?")
                raise FloatingPointError(
                    f"non-finite gradient norm at global step {self.global_step} (first in "
                    f"{first}); stopping before the optimiser corrupts the weights")

    def configure_optimizers(self) -> Any:
        hp = self.hparams
        enc = [p for p in self.captioner.encoder.parameters() if p.requires_grad]
        groups = [{"params": list(self.captioner.decoder.parameters()), "lr": hp.decoder_lr}]
        if enc:
            groups.append({"params": enc, "lr": hp.encoder_lr})
        opt = torch.optim.Adam(groups, weight_decay=hp.weight_decay)
        if hp.lr_schedule == "constant" and hp.warmup_steps <= 0:
            return opt
        total = max(1, int(self.trainer.estimated_stepping_batches))
        warm = max(0, hp.warmup_steps)

        def factor(step: int) -> float:
            if step < warm:
                return (step + 1) / warm
            if hp.lr_schedule == "constant":
                return 1.0
            progress = min(1.0, (step - warm) / max(1, total - warm))
            return 0.5 * (1.0 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # -- evaluation ------------------------------------------------------------------------
    def generate(self, images: Tensor) -> Generation:
        """Decode with the configured strategy: the one path for val, test, CLI and overlays."""
        hp = self.hparams
        return self.captioner.generate(
            images, strategy=hp.eval_strategy, beam_size=hp.beam_size, max_len=hp.max_len,
            length_penalty=hp.length_penalty, forbid_unk=hp.forbid_unk)

    def _eval_step(self, batch: Any, prefix: str) -> None:
        features = self.captioner.encode(batch.images)
        parts = self._losses(batch, features)
        bs = batch.captions.size(0)
        self.log(f"{prefix}/loss", parts["loss"], batch_size=bs, sync_dist=True, prog_bar=True)
        self.log(f"{prefix}/nll_per_word", parts["nll_per_word"], batch_size=bs, sync_dist=True)
        if not self.hparams.compute_metrics or self.vocab is None:
            return
        gen = self.generate(features)
        self._pending.merge(self.to_results(gen, batch.image_ids, batch.references))

    def to_results(self, gen: Generation, image_ids: list[Any],
                   references: list[list[str]] | None = None) -> EvalResults:
        """Decoded words, captions and α maps per image id (special tokens stripped)."""
        assert self.vocab is not None
        res = EvalResults()
        tokens, lengths = gen.tokens.tolist(), gen.lengths.tolist()
        alphas = gen.alphas.float().cpu()
        end = self.vocab.end_id
        for i, image_id in enumerate(image_ids):
            ids = tokens[i][: lengths[i]]
            # Words stay aligned with decoding steps (an <unk> keeps its α map); the caption
            # text drops every special token.
            steps = [self.vocab.itos[t] for t in ids if t != end]
            res.words[image_id] = steps
            res.hypotheses[image_id] = " ".join(self.vocab.decode(ids))
            res.alphas[image_id] = alphas[i, : len(steps)]
            res.scores[image_id] = float(gen.scores[i])
            if references is not None:
                res.references[image_id] = list(references[i])
        return res

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._eval_step(batch, "test")

    def on_validation_epoch_start(self) -> None:
        self._pending = EvalResults()

    on_test_epoch_start = on_validation_epoch_start

    def _gather(self, results: EvalResults) -> EvalResults:
        """Every rank's captions, each image once (DDP samplers may pad with repeats)."""
        if self.trainer.world_size <= 1 or not torch.distributed.is_initialized():
            return results
        parts: list[Any] = [None] * self.trainer.world_size
        torch.distributed.all_gather_object(parts, results)
        merged = EvalResults()
        for p in parts:
            merged.merge(p)
        return merged

    def _finish_eval(self, prefix: str) -> EvalResults:
        results = self._gather(self._pending)
        self._pending = EvalResults()
        if not results.hypotheses or self.trainer.sanity_checking:
            return results
        metrics: dict[str, float] = {}
        if self.trainer.is_global_zero:
            metrics = compute_metrics(results, getattr(self.trainer, "datamodule", None),
                                      grid=self.captioner.grid)
        if self.trainer.world_size > 1 and torch.distributed.is_initialized():
            box = [metrics]
            torch.distributed.broadcast_object_list(box, src=0)
            metrics = box[0]
        results.metrics = metrics
        for name, value in metrics.items():
            self.log(f"{prefix}/{name}", value, rank_zero_only=False, sync_dist=False)
        return results

    def on_validation_epoch_end(self) -> None:
        results = self._finish_eval("val")
        if results.metrics:
            self.val_results = results

    def on_test_epoch_end(self) -> None:
        self.test_results = self._finish_eval("test")
        folder = self._results_folder()  # on every rank: trainer.log_dir is a DDP broadcast
        if self.trainer.is_global_zero and self.test_results.hypotheses:
            self.write_results(self.test_results, "test", folder)

    def _results_folder(self) -> Path:
        return Path(self.hparams.results_dir or self.trainer.log_dir
                    or self.trainer.default_root_dir)

    def write_results(self, results: EvalResults, split: str, folder: Path | None = None) -> Path:
        """COCO results file [{"image_id", "caption"}] and a metrics JSON; returns the folder.

        Default folder: `results_dir`, else the trainer's log dir (a collective under DDP: pass
        `folder` when calling this on one rank only).
        """
        folder = Path(folder) if folder is not None else self._results_folder()
        folder.mkdir(parents=True, exist_ok=True)
        coco = [{"image_id": i, "caption": c} for i, c in results.hypotheses.items()]
        (folder / f"{split}_captions.json").write_text(json.dumps(coco, indent=1))
        (folder / f"{split}_metrics.json").write_text(json.dumps(results.metrics, indent=2))
        log.info("wrote %s and %s", folder / f"{split}_captions.json", folder / f"{split}_metrics.json")
        return folder


def _caption_word_ll(logits: Tensor, captions: Tensor, lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher-forced (B, T) word log-likelihoods of `captions` and the (B, T) real-word mask."""
    T = logits.size(1)
    mask = target_mask(lengths, T)
    return word_log_likelihoods(logits, captions[:, 1 : T + 1], mask), mask


def rng_states() -> dict[str, Any]:
    """The torch (CPU, CUDA), numpy and python RNG states, as tensors and plain data (so that
    checkpoints stay loadable with `torch.load(weights_only=True)`)."""
    import random

    import numpy as np

    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore what `rng_states` returned (missing parts are left alone)."""
    import random

    import numpy as np

    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state(("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])


def encoder_fingerprint(encoder: torch.nn.Module | dict[str, Tensor]) -> str:
    """A hash of the encoder's weights (a module or its state dict): the cache key changes
    when they do."""
    import hashlib

    h = hashlib.sha256()
    state = encoder if isinstance(encoder, dict) else encoder.state_dict()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def compute_metrics(results: EvalResults, datamodule: Any, *, grid: tuple[int, int]) -> dict[str, float]:
    """coco-caption scores, plus objects correct and pointing accuracy when boxes exist."""
    from captioning.metrics import coco_scores, objects_correct, pointing_accuracy

    metrics = coco_scores(results.references, results.hypotheses)
    boxes = getattr(datamodule, "boxes", None)
    if boxes:
        from captioning.data.shapes import scene_objects

        ids = [i for i in results.hypotheses if i in boxes]
        if ids:
            metrics["objects_correct"] = objects_correct(
                {i: results.hypotheses[i] for i in ids}, {i: scene_objects(boxes[i]) for i in ids})
            crop_boxes = datamodule.crop_boxes(ids) if hasattr(datamodule, "crop_boxes") else None
            if crop_boxes is not None:
                acc, _, scored = pointing_accuracy(
                    [results.words[i] for i in ids], [results.alphas[i] for i in ids], grid,
                    crop_boxes)
                if scored:
                    metrics["pointing_accuracy"] = acc
    return metrics
