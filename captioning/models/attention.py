"""Attention over the annotation grid (Xu et al. 2015, §4).

Soft and hard attention share one scorer that produces α_t (Eqs. 4-5). They differ only in the
weights that form the context z_t = Σ_i w_ti a_i:

* soft:   w_t = α_t                      (Eq. 13, the expected context)
* hard:   w_t = one_hot(s_t), s_t ~ Multinoulli(α_t)   (Eqs. 8-9)
* argmax: w_t = one_hot(argmax α_t)      (a deterministic hard decode)
"""

from __future__ import annotations

from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

WeightRule = Literal["expected", "sample", "argmax"]

LOG_EPS = 1e-8  # floor on α before the log, so log p(s|a) and H stay finite


class AdditiveAttention(nn.Module):
    """f_att(a_i, h_{t-1}) = w^T tanh(W_a a_i + W_h h_{t-1} + b) (Eq. 4, Bahdanau scoring)."""

    def __init__(self, *, feature_dim: int, hidden_dim: int, attn_dim: int) -> None:
        super().__init__()
        self.key = nn.Linear(feature_dim, attn_dim)  # W_a, applied once per image
        self.query = nn.Linear(hidden_dim, attn_dim, bias=False)  # W_h
        # No bias on w: α = softmax(e) is invariant to a shift shared by all locations, so a
        # bias here would be a parameter that never receives a gradient.
        self.score = nn.Linear(attn_dim, 1, bias=False)  # w

    def project(self, features: Tensor) -> Tensor:
        """W_a a_i for every location: (B, L, D) -> (B, L, A). Computed once, reused each step."""
        return self.key(features)

    def forward(self, keys: Tensor, h: Tensor) -> Tensor:
        """Scores e_ti (B, L) from projected keys (B, L, A) and the previous hidden state (B, H)."""
        e = self.score(torch.tanh(keys + self.query(h).unsqueeze(1)))  # (B, L, 1)
        return e.squeeze(-1)


class Selection(NamedTuple):
    weights: Tensor  # (B, L) weights forming the context
    alpha: Tensor  # (B, L) attention distribution α_t (Eq. 5)
    location: Tensor  # (B,) chosen location (argmax for expected/argmax, the sample for sample)
    log_prob: Tensor | None  # (B,) log p(s_t | a) of the sample; sample rule only
    entropy: Tensor | None  # (B,) H[α_t]; sample rule only


def select(scores: Tensor, rule: WeightRule) -> Selection:
    """α_t = softmax(e_t) (Eq. 5), then the weights by `rule`."""
    alpha = F.softmax(scores, dim=-1, dtype=torch.float32)  # (B, L), float32 under autocast
    if rule == "expected":
        return Selection(alpha, alpha, alpha.argmax(-1), None, None)
    if rule == "argmax":
        loc = alpha.argmax(-1)
        return Selection(F.one_hot(loc, alpha.size(-1)).to(alpha.dtype), alpha, loc, None, None)
    if rule == "sample":
        loc = torch.multinomial(alpha.detach().float(), 1).squeeze(-1)  # s_t ~ Multinoulli(α_t)
        log_alpha = torch.log(alpha.clamp_min(LOG_EPS))
        log_prob = log_alpha.gather(1, loc.unsqueeze(1)).squeeze(1)  # log p(s_t | a)
        entropy = -(alpha * log_alpha).sum(-1)  # H[s_t]
        weights = F.one_hot(loc, alpha.size(-1)).to(alpha.dtype)
        return Selection(weights, alpha, loc, log_prob, entropy)
    raise ValueError(f"unknown attention weight rule {rule!r}")
