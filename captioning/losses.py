"""Losses as pure functions of tensors (Xu et al. 2015, §4.1 and §4.2.1).

Conventions: `mask` (B, T) is True on real predicted words, False on padding.
Per-caption quantities are summed over time, as in the paper and the authors' capgen.py.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def target_mask(lengths: Tensor, steps: int) -> Tensor:
    """(B, steps) True where step t predicts a real word of a caption of `lengths` tokens."""
    t = torch.arange(steps, device=lengths.device)
    return t.unsqueeze(0) < (lengths - 1).unsqueeze(1)


def word_log_likelihoods(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """log p(y_t | y_<t, s_≤t, a) per word (B, T), zero on padding."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logp * mask


def caption_word_log_likelihoods(logits: Tensor, captions: Tensor,
                                 lengths: Tensor) -> tuple[Tensor, Tensor]:
    """Teacher-forced (B, T) word log-likelihoods of `captions` (<start> first) and the (B, T)
    real-word mask, for decoder logits (B, T, V)."""
    T = logits.size(1)
    mask = target_mask(lengths, T)
    return word_log_likelihoods(logits, captions[:, 1 : T + 1], mask), mask


def reward_to_go(rewards: Tensor, mask: Tensor) -> Tensor:
    """Σ_{t' ≥ t} r_t' per step (B, T), zero on padding."""
    return (rewards * mask).flip(1).cumsum(1).flip(1)  # padding trails, so it sums to zero


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 - Σ_t α_ti)², summed over real steps only, averaged over captions (Eq. 14)."""
    coverage = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # (B, L)
    return ((1.0 - coverage) ** 2).sum(dim=1).mean()


def reinforce_loss(
    reward: Tensor,
    attn_log_probs: Tensor,
    mask: Tensor,
    baseline: Tensor | float,
    *,
    sampled: Tensor | None = None,
) -> Tensor:
    """Surrogate whose gradient is -(R - b) ∂log p(s̃|a)/∂W, averaged over captions (§4.1, Eq. 12).

    `reward` is per caption (B,), R = log p(y|s̃,a) as in the paper, applied to every step's
    log α_{t,s̃_t}; or per step (B, T), e.g. the reward-to-go. `baseline` broadcasts against it.
    The advantage is detached, so only the attention log-probabilities carry gradient.
    Captions that used the expected context (`sampled` False) contribute nothing.
    """
    advantage = (reward.detach() - baseline)  # (B,) or (B, T)
    if advantage.dim() == 1:
        advantage = advantage.unsqueeze(1)
    if sampled is not None:
        advantage = advantage * sampled.to(advantage.dtype).unsqueeze(1)
    return -(advantage * attn_log_probs * mask).sum(dim=1).mean()  # log p(s̃|a) = Σ_t log α


def mean_alpha_entropy(alphas: Tensor, mask: Tensor) -> Tensor:
    """The mean entropy H[α_t] in nats over the real steps, a statistic (no gradient): low for
    attention that picks a few locations, log L for a uniform α over L."""
    with torch.no_grad():
        a = alphas.float()
        h = -(a * a.clamp_min(1e-12).log()).sum(dim=-1)  # (B, T)
        return (h * mask).sum() / mask.sum().clamp_min(1)


def entropy_bonus(attn_entropy: Tensor, mask: Tensor) -> Tensor:
    """Σ_t H[s_t] over real steps, averaged over captions; subtract it to raise entropy."""
    return (attn_entropy * mask).sum(dim=1).mean()


class MovingAverageBaseline(nn.Module):
    """b_k = m·b_{k-1} + (1 - m)·mean log p(y | s̃_k, a), b_0 = 0 (§4.1, m = 0.9).

    A buffer, so it is saved in checkpoints and follows the module across devices.
    """

    def __init__(self, *, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros(()))

    @torch.no_grad()
    def update(self, reward: Tensor) -> Tensor:
        """Fold in the batch mean reward; returns the new value."""
        r = reward.detach().float().mean()
        self.value.mul_(self.momentum).add_((1.0 - self.momentum) * r)
        return self.value


class TokenBaseline(nn.Module):
    """b[v] = m·b[v] + (1 - m)·mean log p(y_t = v | ...) over the batch's words v.

    A moving average per target word, set to its first batch mean the first time the word is
    seen (a zero start would make every early advantage a large negative number). It depends on
    the caption, never on the sampled locations, so R_t − Σ_{t' ≥ t} b[y_t'] stays an unbiased
    advantage with less variance.
    """

    def __init__(self, *, vocab_size: int, momentum: float = 0.9) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("value", torch.zeros(vocab_size))
        self.register_buffer("seen", torch.zeros(vocab_size, dtype=torch.bool))

    def forward(self, targets: Tensor) -> Tensor:
        """b[y_t] per step (B, T)."""
        return self.value[targets]

    @torch.no_grad()
    def update(self, word_rewards: Tensor, targets: Tensor, mask: Tensor, *,
               reduce: Callable[[Tensor], Tensor] | None = None) -> None:
        """Fold in the mean reward of each target word under `mask` (non-finite ones skipped).
        `reduce` sums the (2, V) per-word sums and counts over processes (DDP's all-reduce)."""
        r = word_rewards.detach().float()
        mask = mask & torch.isfinite(r)  # a NaN step must not poison b
        tok, r = targets[mask], r[mask]
        stats = self.value.new_zeros(2, self.value.numel())  # Σ reward and count per word
        stats[0].index_add_(0, tok, r)
        stats[1].index_add_(0, tok, torch.ones_like(r))
        sums, counts = stats if reduce is None else reduce(stats)
        now = counts > 0
        mean = sums / counts.clamp_min(1)
        m = torch.where(self.seen, self.momentum, 0.0)  # first sight: take the batch mean
        self.value.copy_(torch.where(now, m * self.value + (1.0 - m) * mean, self.value))
        self.seen |= now
