"""Training objectives: one class per objective, each owning its state.

An objective runs the captioner's teacher-forced pass on a batch and returns named loss parts;
`parts["loss"]` is what is optimised, the rest is logged. Moving-average baselines are buffers of
the objective, so they are saved in checkpoints and follow the module across devices.

* `MaximumLikelihood`: −log p(y | a) plus λ times the doubly stochastic penalty (Eq. 14), the
  soft-attention objective (§4.2).
* `Reinforce` and its variants: hard attention (§4.1, Eq. 12): the likelihood above plus
  λ_r times the REINFORCE surrogate minus λ_e times the attention entropy. The variants differ
  only in the reward and baseline (`advantage` in the model config):
  `sequence` (the paper), `token` and `expected`. The reward is log p(y | s̃, a) summed over the
  caption's words (`reward: sum`, the paper's Eq. 12) or their mean (`reward: mean`, the
  per-word mean of the authors' capgen.py).
* `GumbelStraightThrough`: hard attention trained with the straight-through Gumbel-softmax
  (`net.hard_estimator: gumbel`): the likelihood minus λ_e times the entropy; no REINFORCE.
* `SelfCritical`: self-critical sequence training (Rennie et al. 2017, `objective: scst`), a
  fine-tuning stage after one of the above: the CIDEr-D of sampled captions as the reward.

Baselines move only in training mode, and under DDP from the statistics of every rank's batch
(summed with `captioning.distributed.all_reduce`), so that all ranks keep the same baselines.

A new REINFORCE estimator is one new class registered under a config value with `@register`;
another hard-attention estimator is one class in `HARD_ESTIMATORS`.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable
from typing import Any, Literal, Protocol

import torch
from torch import Tensor, nn

from captioning.choices import check_choice
from captioning.distributed import all_reduce
from captioning.losses import (
    MovingAverageBaseline,
    TokenBaseline,
    caption_word_log_likelihoods,
    doubly_stochastic_penalty,
    entropy_bonus,
    mean_alpha_entropy,
    reinforce_loss,
    reward_to_go,
)
from captioning.models.captioner import Captioner, DecodeConfig
from captioning.models.decoder import DecoderOutput
from captioning.scst import ScstConfig, ScstReward, first_of_each, mean_of_others, references_of

log = logging.getLogger(__name__)

RewardForm = Literal["sum", "mean"]
ObjectiveKind = Literal["cross_entropy", "scst"]


class Batch(Protocol):
    """What an objective reads from a batch (see `captioning.data.datasets.CaptionBatch`)."""

    captions: Tensor  # (B, T) <start> w1 .. wn <end> <pad> ...
    lengths: Tensor  # (B,) tokens incl. <start> and <end>
    image_ids: list  # (B,) the image of each caption (SCST: one row per image)


class Objective(nn.Module):
    """Batch -> named loss parts; `loss` is optimised. Buffers hold the objective's state."""

    def attach(self, datamodule: Any) -> None:
        """Called by the module's `setup` with the trainer's data module (or None)."""

    def forward(self, captioner: Captioner, features: Tensor,
                batch: Batch) -> dict[str, Tensor]:
        raise NotImplementedError

    def stand_in(self, captioner: Captioner) -> None:
        """`forward`'s DDP collectives with nothing of this rank's in them, for a rank whose
        forward failed: the ranks' collectives stay in step (`training_step`). None here."""


class MaximumLikelihood(Objective):
    """−log p(y | a) per caption, plus `doubly_stochastic` · Σ_i (1 − Σ_t α_ti)² (Eq. 14)."""

    def __init__(self, *, doubly_stochastic: float = 1.0) -> None:
        super().__init__()
        self.doubly_stochastic = doubly_stochastic

    def likelihood(self, out: DecoderOutput, batch: Batch) -> tuple[dict[str, Tensor],
                                                                    Tensor, Tensor]:
        """The likelihood's loss parts, and the (B, T) word log-likelihoods and mask."""
        word_ll, mask = caption_word_log_likelihoods(out.logits, batch.captions, batch.lengths)
        loglik = word_ll.sum(dim=1)  # (B,) log p(y | s̃, a)
        nll = -loglik.mean()
        penalty = doubly_stochastic_penalty(out.alphas, mask)
        parts = {
            "nll": nll,
            "nll_per_word": -loglik.sum() / mask.sum().clamp_min(1),
            "doubly_stochastic": penalty,
            "loss": nll + self.doubly_stochastic * penalty,
            "attn_entropy": mean_alpha_entropy(out.alphas, mask),  # hard: its own, the same
        }
        return parts, word_ll, mask

    def forward(self, captioner: Captioner, features: Tensor,
                batch: Batch) -> dict[str, Tensor]:
        out = captioner.decoder(features, batch.captions, batch.lengths)
        return self.likelihood(out, batch)[0]


#: REINFORCE estimators by their `advantage` config value.
ESTIMATORS: dict[str, type[Reinforce]] = {}


def register(name: str) -> Callable[[type[Reinforce]], type[Reinforce]]:
    """Class decorator: make a REINFORCE estimator available as `advantage: name`."""
    def add(cls: type[Reinforce]) -> type[Reinforce]:
        ESTIMATORS[name] = cls
        return cls
    return add


class Reinforce(MaximumLikelihood):
    """Hard attention (§4.1): likelihood + λ_r · REINFORCE − λ_e · H[α] (Eq. 12).

    The reward is R = log p(y | s̃, a) of the whole caption at every step, against the moving
    average b of R (the paper's `sequence` estimator). Subclasses change `reward_and_baseline`.
    `reward`: `sum` over the caption's words (the paper) or their `mean` (capgen.py, which
    divides by the minibatch's padded length; here each caption's own word count). The baseline
    moves only in training mode.
    """

    #: Whether the advantage is taken against the moving average b of R (`baseline`).
    moving_baseline = True

    def __init__(self, *, doubly_stochastic: float = 1.0, reward_scale: float = 0.1,
                 entropy_weight: float = 0.002, baseline_momentum: float = 0.9,
                 reward: RewardForm = "sum") -> None:
        super().__init__(doubly_stochastic=doubly_stochastic)
        check_choice("reward", reward, RewardForm)
        self.reward_scale = reward_scale
        self.entropy_weight = entropy_weight
        self.reward_form: RewardForm = reward
        self.baseline = MovingAverageBaseline(momentum=baseline_momentum)

    def per_caption(self, x: Tensor, mask: Tensor) -> Tensor:
        """Sums over a caption's words as the reward form asks: unchanged for `sum`, divided by
        the caption's word count for `mean`. `x` is (B,) or (B, T)."""
        if self.reward_form == "sum":
            return x
        n = mask.sum(dim=1).clamp_min(1).to(x.dtype)  # (B,)
        return x / (n if x.dim() == 1 else n.unsqueeze(1))

    def caption_reward(self, word_ll: Tensor, mask: Tensor) -> Tensor:
        """R per caption (B,): log p(y | s̃, a), summed or per word."""
        return self.per_caption(word_ll.sum(dim=1), mask)

    def reward_and_baseline(self, captioner: Captioner, features: Tensor, batch: Batch,
                            word_ll: Tensor, mask: Tensor,
                            sampled: Tensor | None) -> tuple[Tensor, Tensor]:
        """(reward, baseline): per caption (B,) or per step (B, T); broadcastable."""
        return self.caption_reward(word_ll, mask), self.baseline.value

    def forward(self, captioner: Captioner, features: Tensor,
                batch: Batch) -> dict[str, Tensor]:
        out = captioner.decoder(features, batch.captions, batch.lengths)
        parts, word_ll, mask = self.likelihood(out, batch)
        if out.attn_log_probs is None or out.attn_entropy is None:
            return parts  # a soft decoder: nothing was sampled
        sampled = out.sampled
        reward, base = self.reward_and_baseline(captioner, features, batch, word_ll, mask,
                                                sampled)
        rl = reinforce_loss(reward, out.attn_log_probs, mask, base, sampled=sampled)
        entropy = entropy_bonus(out.attn_entropy, mask)
        parts["loss"] = parts["loss"] + self.reward_scale * rl - self.entropy_weight * entropy
        parts.update(reinforce=rl, attn_entropy=entropy / mask.sum(1).float().mean())
        caption_reward = self.caption_reward(word_ll, mask)  # (B,) R of each caption
        if sampled is not None and bool(sampled.any()):
            # the whole caption's advantage (step 0 of a reward-to-go)
            parts["advantage"] = (reward - base).reshape(len(reward), -1)[sampled, 0].mean()
            parts["reward"] = caption_reward[sampled].mean()
        if self.moving_baseline:  # the others keep the buffer only for old checkpoints
            if self.training:  # on every rank, every step: a collective under DDP
                self.update_baseline(caption_reward, sampled)
            parts["baseline"] = self.baseline.value.clone()
        return parts

    def stand_in(self, captioner: Captioner) -> None:
        if self.training and captioner.decoder.attention_kind == "hard":  # its forward sampled
            self.stand_in_reward()
            if self.moving_baseline:
                self.update_baseline(self.baseline.value.new_zeros(0), None)  # none of ours

    def stand_in_reward(self) -> None:
        """`stand_in` for the collectives of `reward_and_baseline`: none here."""

    @torch.no_grad()
    def update_baseline(self, reward: Tensor, rows: Tensor | None) -> None:
        """b_k = m·b_{k−1} + (1 − m)·mean R over the sampled captions (`rows`, all if None) of
        every DDP rank; non-finite rewards are left out (a NaN must not poison b)."""
        r = reward.detach().float()
        keep = torch.isfinite(r) if rows is None else rows & torch.isfinite(r)
        total, n = all_reduce(torch.stack([r[keep].sum(), keep.sum().float()]))  # Σ R, n
        if n > 0:
            self.baseline.update(total / n)


register("sequence")(Reinforce)


@register("token")
class TokenReinforce(Reinforce):
    """R_t = Σ_{t'≥t} log p(y_t' | ...), the reward-to-go (α_t cannot change earlier words),
    against the same sum of per-word moving averages b[y_t']."""

    moving_baseline = False

    def __init__(self, *, vocab_size: int, doubly_stochastic: float = 1.0,
                 reward_scale: float = 0.1, entropy_weight: float = 0.002,
                 baseline_momentum: float = 0.9, reward: RewardForm = "sum") -> None:
        super().__init__(doubly_stochastic=doubly_stochastic, reward_scale=reward_scale,
                         entropy_weight=entropy_weight, baseline_momentum=baseline_momentum,
                         reward=reward)
        self.token_baseline = TokenBaseline(vocab_size=vocab_size, momentum=baseline_momentum)

    def reward_and_baseline(self, captioner: Captioner, features: Tensor, batch: Batch,
                            word_ll: Tensor, mask: Tensor,
                            sampled: Tensor | None) -> tuple[Tensor, Tensor]:
        targets = batch.captions[:, 1 : mask.size(1) + 1]
        base = reward_to_go(self.token_baseline(targets), mask)
        if self.training:  # on every rank, every step: the update is a collective under DDP
            used = mask if sampled is None else mask & sampled.unsqueeze(1)
            self.token_baseline.update(word_ll, targets, used, reduce=all_reduce)
        return self.per_caption(reward_to_go(word_ll, mask), mask), self.per_caption(base, mask)

    def stand_in_reward(self) -> None:
        none = self.token_baseline.value.new_zeros(0)  # no word of ours
        self.token_baseline.update(none, none.long(), none.bool(), reduce=all_reduce)


@register("expected")
class ExpectedReinforce(Reinforce):
    """The reward-to-go against that of the same caption decoded with the expected context:
    a per-caption baseline, one extra forward pass without gradient."""

    moving_baseline = False

    def reward_and_baseline(self, captioner: Captioner, features: Tensor, batch: Batch,
                            word_ll: Tensor, mask: Tensor,
                            sampled: Tensor | None) -> tuple[Tensor, Tensor]:
        ref = expected_word_log_likelihoods(captioner, features, batch, sampled, mask.size(1))
        return (self.per_caption(reward_to_go(word_ll, mask), mask),
                self.per_caption(reward_to_go(ref, mask), mask))


class GumbelStraightThrough(MaximumLikelihood):
    """Hard attention with the straight-through Gumbel-softmax (`net.hard_estimator: gumbel`):
    −log p(y | s̃, a) + doubly stochastic penalty − λ_e · H[α]. The likelihood's gradient
    reaches the scorer through the relaxed sample (the decoder's `tau`); there is no REINFORCE
    term and no baseline. `entropy_weight: 0` drops the entropy term."""

    def __init__(self, *, doubly_stochastic: float = 1.0, entropy_weight: float = 0.002) -> None:
        super().__init__(doubly_stochastic=doubly_stochastic)
        self.entropy_weight = entropy_weight

    def forward(self, captioner: Captioner, features: Tensor,
                batch: Batch) -> dict[str, Tensor]:
        out = captioner.decoder(features, batch.captions, batch.lengths)
        parts, _, mask = self.likelihood(out, batch)
        if out.attn_entropy is None:
            return parts  # the expected context (a soft pass, or an `expected` decode)
        entropy = entropy_bonus(out.attn_entropy, mask)
        parts["loss"] = parts["loss"] - self.entropy_weight * entropy
        parts["attn_entropy"] = entropy / mask.sum(1).float().mean()
        return parts


class SelfCritical(Objective):
    """Self-critical sequence training (Rennie et al. 2017): k captions wˢ sampled per image,
    loss −Σ (r(wˢ) − b) log p(wˢ), r the CIDEr-D of wˢ against the image's references.

    A batch of (image, caption) pairs becomes one row per image (the first pair of each image
    id). log p(wˢ) sums the log-probabilities of the drawn words, <end> included, padding
    masked; the loss is their mean over the U·k sampled captions (per caption, not per word).
    b: the greedy caption's reward (`baseline: greedy`, decoded in eval mode, no gradient) or
    the mean reward of the image's other samples (`mean`). Samples use the decoder's decoding
    rule (`hard_decode` for hard attention): no REINFORCE term on the attention, unless
    `xe_weight` > 0 adds `cross_entropy` (the model's own objective) on the batch's captions.
    Outside training mode the loss is `cross_entropy`'s (the val loss stays the likelihood).
    The reward needs the training references: `attach` a data module (`records("train")` and
    `vocab`); it is built on the first training step.
    """

    def __init__(self, *, cross_entropy: Objective, config: ScstConfig | None = None,
                 forbid_unk: bool = False) -> None:
        super().__init__()
        self.cross_entropy = cross_entropy
        self.config = config or ScstConfig()
        self.forbid_unk = forbid_unk
        self.reward: ScstReward | None = None
        self._datamodule: Any = None

    def attach(self, datamodule: Any) -> None:
        self._datamodule = datamodule

    def reward_model(self) -> ScstReward:
        """The reward, built once from the attached data module's training references."""
        if self.reward is None:
            dm, cfg = self._datamodule, self.config
            if dm is None:
                raise RuntimeError("SCST needs the training references: attach a data module")
            self.reward = ScstReward(references_of(dm.records("train")), dm.vocab,
                                     kind=cfg.reward, bleu_weight=cfg.bleu_weight)
        return self.reward

    def forward(self, captioner: Captioner, features: Tensor,
                batch: Batch) -> dict[str, Tensor]:
        if not self.training:
            return self.cross_entropy(captioner, features, batch)
        cfg, reward = self.config, self.reward_model()
        first, images = first_of_each(batch.image_ids)
        feats = features[first]  # (U, L, D): one row per image
        k = cfg.samples
        gen = captioner.generate(feats, DecodeConfig(
            strategy="sample", num_captions=k, temperature=cfg.temperature, max_len=cfg.max_len,
            forbid_unk=self.forbid_unk), grad=True)  # (U·k, T), image-major
        r = reward(gen.tokens, gen.lengths, [i for i in images for _ in range(k)])  # (U·k,)
        if cfg.baseline == "mean":
            b = mean_of_others(r.view(-1, k)).flatten()  # (U·k,)
        else:
            b = self.greedy_reward(captioner, feats, images).repeat_interleave(k)  # (U·k,)
        T = gen.tokens.size(1)
        mask = torch.arange(T, device=feats.device) < gen.lengths.unsqueeze(1)  # (U·k, T)
        log_p = torch.where(mask, gen.token_log_probs, 0.0).sum(dim=1)  # (U·k,) log p(wˢ)
        advantage = (r - b).detach()
        # ∇L ≈ −(r(wˢ) − b) ∇log p(wˢ): REINFORCE with a baseline, one term per sample (§4)
        parts = {"loss": -(advantage * log_p).mean(),
                 "scst_reward": r.mean(), "scst_baseline": b.mean(),
                 "scst_beat_baseline": (r > b).float().mean(),
                 "scst_sample_len": (gen.lengths - gen.finished.long()).float().mean(),
                 "attn_entropy": mean_alpha_entropy(gen.alphas, mask)}  # the samples' α
        if cfg.xe_weight > 0:
            xe = self.cross_entropy(captioner, features, batch)
            parts["xe_loss"] = xe["loss"]
            parts["loss"] = parts["loss"] + cfg.xe_weight * xe["loss"]
        return parts

    @torch.no_grad()
    def greedy_reward(self, captioner: Captioner, features: Tensor, images: list) -> Tensor:
        """(U,) r(ŵ) of the greedy captions, decoded in eval mode (no dropout)."""
        decoder, was_training = captioner.decoder, captioner.decoder.training
        decoder.eval()
        try:
            gen = captioner.generate(features, DecodeConfig(
                strategy="greedy", max_len=self.config.max_len, forbid_unk=self.forbid_unk))
        finally:
            decoder.train(was_training)
        return self.reward_model()(gen.tokens, gen.lengths, images)


#: Objectives of the hard-attention estimators other than REINFORCE, by `net.hard_estimator`.
HARD_ESTIMATORS: dict[str, type[Objective]] = {"gumbel": GumbelStraightThrough}


@torch.no_grad()
def expected_word_log_likelihoods(captioner: Captioner, features: Tensor, batch: Batch,
                                  rows: Tensor | None, steps: int) -> Tensor:
    """(B, steps) word log-likelihoods of `rows` (all if None) with the expected context;
    zero for the other rows."""
    B = batch.captions.size(0)
    idx = torch.arange(B, device=features.device) if rows is None else rows.nonzero()[:, 0]
    ll = features.new_zeros(B, steps, dtype=torch.float32)
    if idx.numel() == 0:
        return ll
    caps, lengths = batch.captions[idx], batch.lengths[idx]
    ref = captioner.decoder(features[idx], caps, lengths, rule="expected")
    ref_ll, _ = caption_word_log_likelihoods(ref.logits, caps, lengths)
    ll[idx, : ref_ll.size(1)] = ref_ll
    return ll


#: The module's settings that decide the training loss (and so `val/loss`, `test/loss`): an
#: exported model folder keeps them, so that testing it scores as its checkpoint does.
LOSS_SETTINGS = ("objective", "doubly_stochastic", "reward_scale", "entropy_weight",
                 "baseline_momentum", "advantage", "reward", "scst")

#: Training settings and the values they must take: (low, high, low inclusive, high inclusive).
SETTING_RANGES = {"encoder_lr": (0.0, math.inf, False, False),
                  "decoder_lr": (0.0, math.inf, False, False),
                  "weight_decay": (0.0, math.inf, True, False),
                  "warmup_steps": (0, math.inf, True, False),
                  "doubly_stochastic": (0.0, math.inf, True, False),
                  "reward_scale": (0.0, math.inf, True, False),
                  "entropy_weight": (0.0, math.inf, True, False),
                  "baseline_momentum": (0.0, 1.0, True, False)}


def check_settings(settings: dict[str, Any]) -> None:
    """Refuse a training setting outside its range (`SETTING_RANGES`), naming the key."""
    for key, (low, high, low_in, high_in) in SETTING_RANGES.items():
        if key not in settings:
            continue
        v = settings[key]
        ok = (v >= low if low_in else v > low) and (v <= high if high_in else v < high)
        if not ok:
            lo, hi = "[" if low_in else "(", "]" if high_in else ")"
            raise ValueError(f"model.{key} must be in {lo}{low}, {high}{hi}, got {v}")


#: REINFORCE's settings and their defaults: another objective ignores them.
REINFORCE_DEFAULTS = {**{k: p.default for k, p in inspect.signature(Reinforce.__init__)
                         .parameters.items() if p.default is not p.empty
                         and k != "doubly_stochastic"}, "advantage": "sequence"}


def build_objective(*, attention: str, advantage: str = "sequence",
                    hard_estimator: str = "reinforce", objective: str = "cross_entropy",
                    scst: ScstConfig | None = None, **settings: Any) -> Objective:
    """The objective of a model: maximum likelihood for soft attention; for hard attention the
    `hard_estimator` (`HARD_ESTIMATORS`), or with `reinforce` the REINFORCE estimator named by
    `advantage`. `settings` go to the constructor that takes them. `objective: scst` wraps that
    cross-entropy objective in `SelfCritical` with the `scst` settings."""
    check_settings(settings)
    check_choice("objective", objective, ObjectiveKind)
    # Checked whatever the attention: a typo is an error even where the value is unused.
    if advantage not in ESTIMATORS:
        raise ValueError(f"advantage must be one of {sorted(ESTIMATORS)}, got {advantage!r}")
    check_choice("reward", settings.get("reward", "sum"), RewardForm)
    if attention == "soft":
        cls: type[Objective] = MaximumLikelihood
    elif hard_estimator in HARD_ESTIMATORS:
        cls = HARD_ESTIMATORS[hard_estimator]
    elif hard_estimator != "reinforce":
        raise ValueError(f"hard_estimator must be one of "
                         f"{sorted(['reinforce', *HARD_ESTIMATORS])}, got {hard_estimator!r}")
    else:
        cls = ESTIMATORS[advantage]
    accepted = inspect.signature(cls.__init__).parameters
    unused = [f"model.{k} {v!r}" for k, v in {**settings, "advantage": advantage}.items()
              if k in REINFORCE_DEFAULTS and k not in accepted and v != REINFORCE_DEFAULTS[k]
              and not (k == "advantage" and cls in ESTIMATORS.values())]
    if unused:
        log.warning("no effect on %s (%s attention): %s", cls.__name__, attention,
                    ", ".join(unused))
    ce = cls(**{k: v for k, v in settings.items() if k in accepted})
    if objective == "cross_entropy":
        return ce
    return SelfCritical(cross_entropy=ce, config=scst,
                        forbid_unk=bool(settings.get("forbid_unk", False)))
