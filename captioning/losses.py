"""Losses as pure functions of tensors (Xu et al. 2015, §4.1 and §4.2.1).

Conventions: `mask` (B, T) is True on real predicted words, False on padding.
Per-caption quantities are summed over time, as in the paper and the authors' capgen.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def target_mask(lengths: Tensor, steps: int) -> Tensor:
    """(B, steps) True where step t predicts a real word of a caption of `lengths` tokens."""
    t = torch.arange(steps, device=lengths.device)
    return t.unsqueeze(0) < (lengths - 1).unsqueeze(1)


def sequence_log_likelihood(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """log p(y | a) per caption (B,): Σ_t log p(y_t | ...) over real words only."""
    logp = F.log_softmax(logits.float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (logp * mask).sum(dim=1)


def masked_cross_entropy(logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """Mean over captions of the summed negative log-likelihood; padding adds nothing."""
    return -sequence_log_likelihood(logits, targets, mask).mean()


def doubly_stochastic_penalty(alphas: Tensor, mask: Tensor) -> Tensor:
    """Σ_i (1 - Σ_t α_ti)², summed over real steps only, averaged over captions (Eq. 14)."""
    coverage = (alphas * mask.unsqueeze(-1)).sum(dim=1)  # (B, L)
    return ((1.0 - coverage) ** 2).sum(dim=1).mean()


def reinforce_loss(
    log_likelihood: Tensor,
    attn_log_probs: Tensor,
    mask: Tensor,
    baseline: Tensor | float,
    *,
    sampled: Tensor | None = None,
) -> Tensor:
    """Surrogate whose gradient is -(log p(y|s̃,a) - b) ∂log p(s̃|a)/∂W, averaged (§4.1, Eq. 12).

    The advantage is detached, so only the attention log-probabilities carry gradient.
    Captions that used the expected context (`sampled` False) contribute nothing.
    """
    advantage = (log_likelihood.detach() - baseline)  # (B,)
    log_p_s = (attn_log_probs * mask).sum(dim=1)  # log p(s̃ | a) = Σ_t log α_{t, s̃_t}
    if sampled is not None:
        advantage = advantage * sampled.to(advantage.dtype)
    return -(advantage * log_p_s).mean()


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
