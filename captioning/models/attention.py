"""Attention over the annotation grid (Xu et al. 2015, §4).

A scorer gives e_ti = f_att(a_i, h_{t-1}) (Eq. 4); `select` turns the scores into α_t = softmax(e_t)
(Eq. 5) and the weights that form the context z_t = Σ_i w_ti a_i (Eq. 6, `context`):

* soft:   w_t = α_t                      (Eq. 13, the expected context)
* hard:   w_t = one_hot(s_t), s_t ~ Multinoulli(α_t)   (Eqs. 8-9)
* argmax: w_t = one_hot(argmax α_t)      (a deterministic hard decode)
* gumbel: w_t = one_hot(argmax(log α_t + g)) in the forward pass, with the gradient of
          softmax((log α_t + g) / τ) in the backward pass (straight-through Gumbel-softmax,
          Jang et al. 2017; Maddison et al. 2017), g ~ Gumbel(0, 1)

Scorers (`SCORERS`, the config's `net.score`): the paper's f_att, an MLP conditioned on h_{t-1},
in the additive form of capgen.py and Bahdanau et al. (2015),
Luong et al.'s (2015) dot and general (bilinear) scores, and the Transformer's scaled dot product.
Each projects the annotations once per image (`project`, the decoder's `Memory.keys`); decoding
never re-projects the grid.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import captioning.models.native as native
from captioning.choices import check_choice
from captioning.models.pass_grads import PassGradient, RecurrentProduct, linear
from captioning.models.state import grid_dtype

WeightRule = Literal["expected", "sample", "argmax"]  # decode-time rules (`net.hard_decode`)
SelectRule = Literal["expected", "sample", "argmax", "gumbel"]  # every rule of `select`
Anneal = Literal["constant", "linear", "exponential"]
Normalizer = Literal["softmax", "sparsemax"]  # e_t -> α_t (`net.normalizer`)

LOG_EPS = 1e-8  # floor on α before the log, so log p(s|a) and H stay finite


def key_layers(dim: int, n_layers: int) -> nn.Sequential:
    """capgen.py's `n_layers_att`: n − 1 extra tanh layers on the projected annotations,
    tanh(W_l k + b_l) (W_att_l in the authors' code). Empty, without parameters, for n = 1."""
    if n_layers < 1:
        raise ValueError(f"n_layers_att must be >= 1, got {n_layers}")
    layers: list[nn.Module] = []
    for _ in range(n_layers - 1):
        layers += [nn.Linear(dim, dim), nn.Tanh()]
    return nn.Sequential(*layers)


class Scorer(nn.Module):
    """f_att: `project` annotations (B, L, D) to keys (B, L, K) once per image, then
    `forward(keys, h)` gives the scores e_t (b, L) at every step, for h (b, H): the first
    b ≤ B rows of the keys (the teacher-forced pass drops captions as they end, and slicing the
    keys itself would cost a zero-filled (B, L, K) gradient each time), or with `rows` (b,)
    caption c scores keys[rows[c]] (the pass's one row per distinct image). A teacher-forced
    pass may give `keys_grad`, where a scorer's backward can sum the keys' gradient over the
    steps in place (`captioning.models.pass_grads`); the CPU additive score does, the others
    leave it to autograd. It may also give `query`, its product by the `query` layer's weight
    (`query_product`), which sums that weight's gradient once a pass, not once a step; that
    pass then reads the layer's weight and bias without calling it (its hooks do not run)."""

    key: nn.Linear  # W_a (or W_k, W), applied once per image

    def __init__(self, *, key_dim: int, n_layers: int = 1) -> None:
        super().__init__()
        self.deep = key_layers(key_dim, n_layers)
        self.query: nn.Linear | None = None  # W_q (or W_h), for the scores that project h
        self.native = False  # score with a native CPU kernel (`use_native`)

    def use_native(self, on: bool) -> bool:
        """Score with a native CPU kernel where this scorer has one and it builds here (the
        decoder's `fast_path: native`); whether it now does."""
        return False

    def project(self, features: Tensor, *, onednn: bool = False) -> Tensor:
        """Keys of every location: (B, L, D) -> (B, L, K). Computed once, reused each step.
        `onednn`: W_a's product by oneDNN where it takes it (`pass_grads.linear`), the `key`
        module's hooks not run."""
        if not onednn:
            return self.deep(self.key(features))
        return self.deep(linear(features, self.key.weight, self.key.bias, onednn=True))

    def forward(self, keys: Tensor, h: Tensor, *, keys_grad: PassGradient | None = None,
                rows: Tensor | None = None, query: RecurrentProduct | None = None) -> Tensor:
        raise NotImplementedError

    def query_product(self, *, onednn: bool = False) -> RecurrentProduct | None:
        """h_{t-1} W_q^T for the steps of one teacher-forced pass (None: no `query` layer);
        `onednn`: by oneDNN where it takes it (`RecurrentProduct`)."""
        return None if self.query is None else RecurrentProduct(self.query.weight.t(),
                                                                onednn=onednn)

    def project_query(self, h: Tensor, query: RecurrentProduct | None) -> Tensor:
        """W_q h_{t-1} (+ the layer's bias) (b, A), by the pass's `query` product if given."""
        assert self.query is not None, "this scorer has no query layer"
        return self.query(h) if query is None else query(self.query.bias, h)

    @staticmethod
    def running_keys(keys: Tensor, b: int, rows: Tensor | None) -> Tensor:
        """The keys that b captions score (b, L, K): the first b rows, or rows `rows`."""
        return keys[:b] if rows is None else keys.index_select(0, rows)


class AdditiveScore(torch.autograd.Function):
    """e = w^T tanh(k + q) (Eq. 4) for the first b rows of the keys (N, L, A), with q (b, A)
    and w (1, A): forward, two passes over the (b, L, A) tensor and the product that reads it;
    backward, five operations over it.

    On the CPU this is the training step's largest cost, bound by memory traffic. So tanh is
    kept as s = σ(2(k + q)), tanh = 2s − 1 (σ is 6× faster there than `torch.tanh` in fp32,
    2.4× in bf16): then e = 2 w^T s − Σw and 1 − tanh² = 4 s (1 − s), and the (b, L, A) tensor
    is never rescaled.
    The backward adds the keys' gradient straight into one (N, L, A) sum: no zero-filled slice
    gradient, no outer-product matmul, and dq = Σ_i (1 − t²) g · w takes w out of the sum. Under
    autocast everything runs in the keys' dtype (bf16): an elementwise op over (b, L, A) with
    mixed dtypes is about 30× slower on the CPU. (docs/benchmarks.md has what was measured.)"""

    @staticmethod
    def forward(ctx: Any, keys: Tensor, q: Tensor, w: Tensor,  # type: ignore[override]
                keys_grad: PassGradient | None) -> Tensor:
        k = keys[: q.size(0)]  # (b, L, A)
        # 2(k + q) in one pass (expand: a broadcast add is slower)
        s = torch.add((2 * q).to(k.dtype).unsqueeze(1).expand_as(k), k, alpha=2).sigmoid_()
        ctx.save_for_backward(s, w)
        ctx.n_keys, ctx.keys_grad = keys.size(0), keys_grad
        b, L, A = s.shape
        with torch.autocast(k.device.type, enabled=False):  # no (b, L, A) cast to bf16
            # w^T (2s − 1) = 2 w^T s − Σw, the shift added inside the product: in bf16 it is
            # rounded once, at the scale of e, not of 2 w^T s
            shift = (-w.sum()).to(s.dtype).expand(b * L, 1)
            return torch.addmm(shift, s.view(b * L, A), (2 * w).to(s.dtype).view(A, 1)).view(b, L)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor | None, Tensor, Tensor, None]:
        s, w = ctx.saved_tensors
        b, L, A = s.shape
        g = g.to(s.dtype)
        # dw = Σ g t = 2 Σ g s − Σ g; a bmm is faster than one (bL)-long product
        dw = torch.bmm(g.unsqueeze(1), s).sum(0).mul_(2).sub_(g.sum())  # (1, A)
        sink: PassGradient | None = ctx.keys_grad
        dkeys = None if sink is not None else s.new_empty(ctx.n_keys, L, A)
        u = s.new_empty(b, L, A) if dkeys is None else dkeys[:b]
        torch.addcmul(s, s, s, value=-1, out=u).mul_(4 * g.unsqueeze(-1))  # (1 − t²) g
        w = w[0].to(u.dtype)
        dq = u.sum(1).mul_(w)  # (b, A)
        if sink is not None:  # summed over the pass in place: only the running rows
            sink.add_rows(u, scale=w)
        else:
            u.mul_(w)
            dkeys[b:].zero_()  # rows past the batch's running captions
        return dkeys, dq, dw, None


class AdditiveAttention(Scorer):
    """f_att(a_i, h_{t-1}) = w^T tanh(W_a a_i + W_h h_{t-1} + b) (Eq. 4, Bahdanau scoring)."""

    def __init__(self, *, feature_dim: int, hidden_dim: int, attn_dim: int,
                 n_layers: int = 1) -> None:
        super().__init__(key_dim=attn_dim, n_layers=n_layers)
        self.key = nn.Linear(feature_dim, attn_dim)  # W_a, applied once per image
        self.query = nn.Linear(hidden_dim, attn_dim, bias=False)  # W_h
        # No bias on w: α = softmax(e) is invariant to a shift shared by all locations, so a
        # bias here would be a parameter that never receives a gradient.
        self.score = nn.Linear(attn_dim, 1, bias=False)  # w

    def use_native(self, on: bool) -> bool:
        self.native = on and native.available()
        return self.native

    def forward(self, keys: Tensor, h: Tensor, *, keys_grad: PassGradient | None = None,
                rows: Tensor | None = None, query: RecurrentProduct | None = None) -> Tensor:
        """Scores e_ti (b, L) from the previous hidden state h_{t-1} (b, H) and the keys."""
        q = self.project_query(h, query)  # (b, A)
        if self.native and native.usable(keys):  # one pass each way (captioning.models.native)
            return native.NativeAdditiveScore.apply(keys, q, self.score.weight, keys_grad, rows)
        if rows is not None:  # the ATen ops read the first b rows: each caption's keys, copied
            keys, keys_grad = keys.index_select(0, rows), None
        if keys.device.type == "cpu":  # one kernel chain instead of autograd's five (B, L, A) ops
            return AdditiveScore.apply(keys, q, self.score.weight, keys_grad)
        k = keys[: q.size(0)]
        return self.score(torch.tanh(k + q.unsqueeze(1))).squeeze(-1)  # (b, L)


class DotAttention(Scorer):
    """e_ti = (W_q h_{t-1})^T (W_k a_i), both projected to attn_dim (Luong et al. 2015, "dot").
    No biases: a key-side bias adds (W_q h)^T b_k, shared by all locations (softmax ignores it);
    a query-side one adds b_q^T W_k a_i, a fixed prior over locations that does not depend on
    h, which the score is meant to be a function of."""

    def __init__(self, *, feature_dim: int, hidden_dim: int, attn_dim: int,
                 n_layers: int = 1) -> None:
        super().__init__(key_dim=attn_dim, n_layers=n_layers)
        self.key = nn.Linear(feature_dim, attn_dim, bias=False)  # W_k, once per image
        self.query = nn.Linear(hidden_dim, attn_dim, bias=False)  # W_q

    def forward(self, keys: Tensor, h: Tensor, *, keys_grad: PassGradient | None = None,
                rows: Tensor | None = None, query: RecurrentProduct | None = None) -> Tensor:
        q = self.project_query(h, query).unsqueeze(2)  # (b, A, 1)
        return torch.bmm(self.running_keys(keys, q.size(0), rows), q).squeeze(2)  # (b, L)


class ScaledDotAttention(DotAttention):
    """The dot score divided by √attn_dim (Vaswani et al. 2017), so its scale does not grow
    with the projection's size."""

    def __init__(self, *, feature_dim: int, hidden_dim: int, attn_dim: int,
                 n_layers: int = 1) -> None:
        super().__init__(feature_dim=feature_dim, hidden_dim=hidden_dim, attn_dim=attn_dim,
                         n_layers=n_layers)
        self.scale = 1.0 / math.sqrt(attn_dim)

    def forward(self, keys: Tensor, h: Tensor, *, keys_grad: PassGradient | None = None,
                rows: Tensor | None = None, query: RecurrentProduct | None = None) -> Tensor:
        return super().forward(keys, h, keys_grad=keys_grad, rows=rows,
                               query=query) * self.scale  # (b, L)


class GeneralAttention(Scorer):
    """e_ti = h_{t-1}^T W a_i (Luong et al. 2015, "general", bilinear). The keys W a_i (B, L, H)
    are computed once per image, so each step is one batched dot product."""

    def __init__(self, *, feature_dim: int, hidden_dim: int, attn_dim: int,
                 n_layers: int = 1) -> None:
        super().__init__(key_dim=hidden_dim, n_layers=n_layers)  # attn_dim is not used
        self.key = nn.Linear(feature_dim, hidden_dim, bias=False)  # W

    def forward(self, keys: Tensor, h: Tensor, *, keys_grad: PassGradient | None = None,
                rows: Tensor | None = None, query: RecurrentProduct | None = None) -> Tensor:
        keys = self.running_keys(keys, h.size(0), rows)
        return torch.bmm(keys, h.unsqueeze(2)).squeeze(2)  # (b, L)


#: Scorers by their `net.score` config value (which may also be a class's import path).
SCORERS: dict[str, type[Scorer]] = {
    "additive": AdditiveAttention,
    "dot": DotAttention,
    "general": GeneralAttention,
    "scaled_dot": ScaledDotAttention,
}


def scorer_class(score: str) -> type[Scorer]:
    """The scorer class `score` names: a key of `SCORERS`, or the import path of a `Scorer`
    subclass of one's own (`my_project.attention.MyScore`), built with the keyword arguments
    SCORERS' classes take (feature_dim, hidden_dim, attn_dim, n_layers). Its module must be
    imported already (`captioning --import MODULE ...`, or `import` in Python): settings, which
    checkpoints and model folders carry, never import code. Raises ValueError."""
    if score in SCORERS:
        return SCORERS[score]
    module, _, name = score.rpartition(".")
    if not module:
        raise ValueError(f"score must be one of {sorted(SCORERS)} or the import path of a "
                         f"Scorer subclass (package.module.Class), got {score!r}")
    if module not in sys.modules:
        raise ValueError(f"score {score!r}: module {module} is not imported (settings never "
                         f"import code): run `captioning --import {module} ...`, or import it "
                         "in Python first")
    cls = getattr(sys.modules[module], name, None)
    if cls is None:
        raise ValueError(f"score {score!r}: module {module} has no {name}")
    if not (isinstance(cls, type) and issubclass(cls, Scorer)):
        raise ValueError(f"score {score!r} is not a subclass of "
                         "captioning.models.attention.Scorer")
    return cls


def build_scorer(score: str, *, feature_dim: int, hidden_dim: int, attn_dim: int,
                 n_layers: int = 1) -> Scorer:
    """The scorer `score` names (`scorer_class`)."""
    return scorer_class(score)(feature_dim=feature_dim, hidden_dim=hidden_dim,
                               attn_dim=attn_dim, n_layers=n_layers)


@dataclass(frozen=True)
class GumbelSchedule:
    """Temperature τ of the Gumbel-softmax relaxation over training: from `start` to `end` over
    `steps` optimiser steps (0: the run's total), `linear` or `exponential` (geometric); then
    `end`. `constant` keeps `start`."""

    start: float = 1.0
    end: float = 0.5
    anneal: Anneal = "exponential"
    steps: int = 0

    def __post_init__(self) -> None:
        if self.start <= 0 or self.end <= 0:
            raise ValueError(f"gumbel τ must be > 0, got start {self.start}, end {self.end}")
        check_choice("gumbel_anneal", self.anneal, Anneal)
        if self.steps < 0:
            raise ValueError(f"gumbel_anneal_steps must be >= 0, got {self.steps}")

    def tau(self, step: int, total: int) -> float:
        """τ at optimiser step `step` of a run of `total` steps (`self.steps` when set)."""
        span = self.steps or total
        if self.anneal == "constant" or span <= 0:
            return self.start
        p = min(1.0, max(0.0, step / span))
        if self.anneal == "linear":
            return self.start + (self.end - self.start) * p
        return self.start * (self.end / self.start) ** p


class Selection(NamedTuple):
    weights: Tensor  # (B, L) weights forming the context
    alpha: Tensor  # (B, L) attention distribution α_t (Eq. 5)
    location: Tensor  # (B,) chosen location (argmax for expected/argmax, else the sample)
    log_prob: Tensor | None  # (B,) log α at the chosen location; sample and gumbel rules only
    entropy: Tensor | None  # (B,) H[α_t]; sample and gumbel rules only


def sample_gumbel(like: Tensor) -> Tensor:
    """g ~ Gumbel(0, 1) of `like`'s shape: −log(−log u), u ~ U[0, 1) kept off 0 (`rand`
    never gives 1)."""
    u = torch.rand_like(like, dtype=torch.float32).clamp_min(LOG_EPS)
    return -torch.log(-torch.log(u))


def gumbel_straight_through(log_alpha: Tensor, tau: float | Tensor,
                            noise: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """(weights, location): one-hot of argmax(log α + g) forward; the gradient of the relaxed
    sample y = softmax((log α + g) / τ) backward. y − y.detach() is exactly zero, so the
    forward weights are exactly one-hot."""
    g = sample_gumbel(log_alpha) if noise is None else noise
    perturbed = log_alpha + g  # (B, L)
    y_soft = F.softmax(perturbed / tau, dim=-1)
    loc = perturbed.argmax(-1)
    y_hard = F.one_hot(loc, log_alpha.size(-1)).to(y_soft.dtype)
    return y_hard + (y_soft - y_soft.detach()), loc


def sparsemax(scores: Tensor) -> Tensor:
    """α = max(e − τ(e), 0): the Euclidean projection of the scores (B, L) onto the simplex
    (Martins & Astudillo 2016), in float32. Exactly zero outside a support; the gradient
    (autograd's, through the sort) is δ_ij − 1/|S| on the support S, zero elsewhere."""
    z = scores.float()
    z = z - z.max(dim=-1, keepdim=True).values.detach()  # shift-invariant: exact at any offset
    z_sorted = z.sort(dim=-1, descending=True).values
    k = torch.arange(1, z.size(-1) + 1, device=z.device, dtype=z.dtype)
    cumsum = z_sorted.cumsum(dim=-1)
    k_max = (1 + k * z_sorted > cumsum).sum(dim=-1, keepdim=True)  # |S| >= 1: the top score
    k_max = k_max.clamp_min(1)  # 0 only for a row with NaN or inf: it stays NaN, as softmax's
    tau = (cumsum.gather(-1, k_max - 1) - 1) / k_max.to(z.dtype)
    return torch.clamp(z - tau, min=0)


def select(scores: Tensor, rule: SelectRule, *, tau: float | Tensor = 1.0,
           noise: Tensor | None = None, normalizer: Normalizer = "softmax") -> Selection:
    """α_t = softmax(e_t) (Eq. 5), or `sparsemax` (soft attention only), then the weights by
    `rule` (`tau` and the Gumbel `noise` (B, L) apply to the gumbel rule; fresh noise when
    None)."""
    if normalizer != "softmax" and rule != "expected":  # its α is no distribution to sample
        raise ValueError(f"normalizer {normalizer!r} is for soft attention (rule 'expected'), "
                         f"not rule {rule!r}")
    alpha = sparsemax(scores) if normalizer == "sparsemax" else \
        F.softmax(scores, dim=-1, dtype=torch.float32)  # (B, L), float32 under autocast
    if rule == "expected":
        return Selection(alpha, alpha, alpha.argmax(-1), None, None)
    if rule == "argmax":
        loc = alpha.argmax(-1)
        return Selection(F.one_hot(loc, alpha.size(-1)).to(alpha.dtype), alpha, loc, None, None)
    if rule not in ("sample", "gumbel"):
        raise ValueError(f"unknown attention weight rule {rule!r}")
    log_alpha = torch.log(alpha.clamp_min(LOG_EPS))
    entropy = -(alpha * log_alpha).sum(-1)  # H[s_t]
    if rule == "sample":
        loc = torch.multinomial(alpha.detach().float(), 1).squeeze(-1)  # s_t ~ Multinoulli(α_t)
        weights = F.one_hot(loc, alpha.size(-1)).to(alpha.dtype)
    else:  # log α + g with the exact log-softmax: no floor where it would bias the relaxation
        exact = F.log_softmax(scores, dim=-1, dtype=torch.float32)
        weights, loc = gumbel_straight_through(exact, tau, noise)
    log_prob = log_alpha.gather(1, loc.unsqueeze(1)).squeeze(1)  # log p(s_t | a)
    return Selection(weights, alpha, loc, log_prob, entropy)


def context(weights: Tensor, values: Tensor, rows: Tensor | None = None, *,
            wide: torch.dtype = torch.float32) -> Tensor:
    """z_t = Σ_i w_ti a_i (Eq. 6): weights (b, L) over the annotations (b, L, D), or with
    `rows` (b,) over rows rows[c] of (N, L, D) (the native kernel, for a frozen grid) ->
    (b, D) in the annotations' dtype. A float16 grid (cached) holds float32 values: z is
    float32 (`wide`: the model's dtype, where it was cast)."""
    if rows is not None:
        if native.usable(values, values=True) and not values.requires_grad:
            return native.NativeContext.apply(weights, values, rows)
        values = values.index_select(0, rows)
    values = values.to(grid_dtype(values.dtype, wide))
    w = weights.to(values.dtype)  # α is float32 (softmax), a_i may be bf16
    return torch.bmm(w.unsqueeze(1), values).squeeze(1)
