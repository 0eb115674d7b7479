"""LSTM decoder with attention (Xu et al. 2015, §3.1.2 and §4).

The decoder exposes three calls that every decoding strategy needs:

* `memory(features)`   projects the annotations once per image (W_a a_i);
* `init_state(memory)` gives h_0, c_0 from MLPs of the mean annotation;
* `step(tokens, state, memory)` advances one word and returns log p(y_t), the state and α_t.

`forward` is the teacher-forced pass used for training. It runs each step only on the captions
that are still going (the batch is sorted by length), so no LSTM work is spent on padding.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from captioning.models.attention import AdditiveAttention, Selection, WeightRule, select

AttentionKind = Literal["soft", "hard"]
SemiSampling = Literal["image", "batch"]


class Memory(NamedTuple):
    """What the decoder attends over; fixed for a caption, never reordered by beam search."""

    values: Tensor  # (B, L, D) annotation vectors a_i
    keys: Tensor  # (B, L, A) W_a a_i


class DecoderState(NamedTuple):
    """Recurrent state. Every field has the batch first, so beam search can reorder it."""

    h: Tensor  # (B, H)
    c: Tensor  # (B, H)
    location: Tensor  # (B,) location chosen at the last step (argmax α for soft models)


@dataclass
class DecoderOutput:
    """Teacher-forced outputs for T = max(lengths) - 1 predicted words."""

    logits: Tensor  # (B, T, V)
    alphas: Tensor  # (B, T, L), zero past each caption's end
    attn_log_probs: Tensor | None = None  # (B, T) log p(s_t | a) of the sampled locations
    attn_entropy: Tensor | None = None  # (B, T) H[α_t]
    sampled: Tensor | None = None  # (B,) bool: the caption used sampled (not expected) context


class AttentionLSTMDecoder(nn.Module):
    """Show, Attend and Tell decoder; `attention` picks soft or hard (stochastic) attention."""

    def __init__(
        self,
        *,
        vocab_size: int,
        feature_dim: int,
        embed_dim: int = 512,
        hidden_dim: int = 512,
        attn_dim: int = 512,
        dropout: float = 0.5,
        attention: AttentionKind = "soft",
        hard_decode: WeightRule = "expected",
        semi_sampling_prob: float = 0.5,
        semi_sampling: SemiSampling = "image",
    ) -> None:
        super().__init__()
        if attention not in ("soft", "hard"):
            raise ValueError(f"attention must be 'soft' or 'hard', got {attention!r}")
        if hard_decode not in ("expected", "argmax", "sample"):
            raise ValueError(f"hard_decode must be expected|argmax|sample, got {hard_decode!r}")
        if semi_sampling not in ("image", "batch"):
            raise ValueError(f"semi_sampling must be 'image' or 'batch', got {semi_sampling!r}")
        if not 0.0 <= semi_sampling_prob <= 1.0:
            raise ValueError(f"semi_sampling_prob must be in [0, 1], got {semi_sampling_prob}")
        self.vocab_size = vocab_size
        self.attention_kind: AttentionKind = attention
        self.hard_decode: WeightRule = hard_decode
        self.semi_sampling_prob = semi_sampling_prob
        self.semi_sampling: SemiSampling = semi_sampling

        self.embed = nn.Embedding(vocab_size, embed_dim)  # E
        self.init_h = nn.Linear(feature_dim, hidden_dim)  # f_init,h
        self.init_c = nn.Linear(feature_dim, hidden_dim)  # f_init,c
        self.attention = AdditiveAttention(
            feature_dim=feature_dim, hidden_dim=hidden_dim, attn_dim=attn_dim
        )
        self.gate = nn.Linear(hidden_dim, 1)  # f_β
        self.lstm = nn.LSTMCell(embed_dim + feature_dim, hidden_dim)  # T_{D+m+n,n}
        self.out_h = nn.Linear(hidden_dim, embed_dim)  # L_h
        self.out_z = nn.Linear(feature_dim, embed_dim, bias=False)  # L_z
        self.out = nn.Linear(embed_dim, vocab_size)  # L_o
        self.dropout = nn.Dropout(dropout)

    # -- the step API -----------------------------------------------------------------------
    def memory(self, features: Tensor) -> Memory:
        """Annotations (B, L, D) and their projection W_a a_i (B, L, A), computed once."""
        return Memory(features, self.attention.project(features))

    def init_state(self, memory: Memory) -> DecoderState:
        """c_0 = f_init,c(mean a_i), h_0 = f_init,h(mean a_i) (§3.1.2)."""
        mean = memory.values.mean(dim=1)  # (B, D)
        h = torch.tanh(self.init_h(mean))
        c = torch.tanh(self.init_c(mean))
        loc = torch.zeros(mean.size(0), dtype=torch.long, device=mean.device)
        return DecoderState(h, c, loc)

    def step(
        self, tokens: Tensor, state: DecoderState, memory: Memory
    ) -> tuple[Tensor, DecoderState, Tensor]:
        """One word: tokens y_{t-1} (B,) -> log p(y_t) (B, V), new state, α_t (B, L)."""
        emb = self.embed(tokens)  # (B, E)
        h, c, z_hat, sel = self._advance(emb, state.h, state.c, memory, self.step_rule)
        logits = self._output(emb, h, z_hat)
        return F.log_softmax(logits.float(), dim=-1), DecoderState(h, c, sel.location), sel.alpha

    @property
    def step_rule(self) -> WeightRule:
        """The weight rule used at decoding time."""
        return "expected" if self.attention_kind == "soft" else self.hard_decode

    # -- internals -------------------------------------------------------------------------
    def _advance(
        self,
        emb: Tensor,
        h: Tensor,
        c: Tensor,
        memory: Memory,
        rule: WeightRule,
        use_expected: Tensor | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Selection]:
        scores = self.attention(memory.keys, h)  # e_ti = f_att(a_i, h_{t-1}) (Eq. 4)
        sel = select(scores, rule)  # α_t (Eq. 5) and the weights
        weights = sel.weights
        if use_expected is not None:
            # Semi-sampling (§4.1): these captions use the expected context instead of the sample.
            # α is detached: in hard mode the scorer learns only from REINFORCE and entropy terms.
            weights = torch.where(use_expected.unsqueeze(1), sel.alpha.detach(), weights)
        weights = weights.to(memory.values.dtype)  # α is float32 (softmax), a_i may be bf16
        z = torch.bmm(weights.unsqueeze(1), memory.values).squeeze(1)  # z_t = Σ_i w_ti a_i (Eq. 6)
        beta = torch.sigmoid(self.gate(h))  # β_t = σ(f_β(h_{t-1})) (§4.2.1)
        z_hat = beta * z  # (B, D)
        h, c = self.lstm(torch.cat([emb, z_hat], dim=1), (h, c))  # Eqs. 1-3
        return h, c, z_hat, sel

    def _output(self, emb: Tensor, h: Tensor, z_hat: Tensor) -> Tensor:
        """Deep output: p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t)) (Eq. 7)."""
        x = emb + self.out_h(self.dropout(h)) + self.out_z(z_hat)
        return self.out(self.dropout(x))

    def _training_rule(self) -> tuple[WeightRule, bool]:
        """(rule, semi-sample?) for the teacher-forced pass."""
        if self.attention_kind == "soft":
            return "expected", False
        if self.training:
            return "sample", True
        return self.hard_decode, False

    def _semi_sampling_coin(self, batch: int, device: torch.device) -> Tensor:
        """True where a caption uses the expected context: per image, or one coin per batch."""
        n = batch if self.semi_sampling == "image" else 1
        coin = torch.rand(n, device=device) < self.semi_sampling_prob
        return coin.expand(batch) if n == 1 else coin

    # -- teacher forcing -------------------------------------------------------------------
    def forward(self, features: Tensor, captions: Tensor, lengths: Tensor, *,
                rule: WeightRule | None = None) -> DecoderOutput:
        """features (B, L, D); captions (B, T+1) starting with <start>; lengths (B,) incl. specials.

        `rule` forces one weight rule for every caption (no semi-sampling); by default soft
        uses the expected context, and hard samples while training and decodes otherwise.
        """
        steps = (lengths - 1).clamp_min(0)  # words to predict per caption
        steps_cpu = steps.tolist()
        order = sorted(range(len(steps_cpu)), key=lambda i: -steps_cpu[i])
        is_sorted = order == list(range(len(order)))
        if not is_sorted:
            perm = torch.tensor(order, device=captions.device)
            features, captions = features[perm], captions[perm]
            steps_cpu = [steps_cpu[i] for i in order]
        B, T = captions.size(0), max(steps_cpu, default=0)
        L = features.size(1)

        memory = self.memory(features)
        state = self.init_state(memory)
        h, c = state.h, state.c
        emb = self.embed(captions[:, :T])  # (B, T, E): inputs y_0 .. y_{T-1}
        rule, semi = self._training_rule() if rule is None else (rule, False)
        use_expected = self._semi_sampling_coin(B, features.device) if semi else None

        # Per-step outputs are collected in lists and padded once: writing into preallocated
        # (B, T, ...) buffers would make autograd copy the whole buffer at every step.
        hs: list[Tensor] = []
        zs: list[Tensor] = []
        alphas_t: list[Tensor] = []
        log_ps_t: list[Tensor] = []
        ents_t: list[Tensor] = []
        active = B
        mem_t, ue = memory, use_expected
        for t in range(T):
            while active > 0 and steps_cpu[active - 1] <= t:
                active -= 1  # captions are sorted longest first: shrink to those still going
            if active < h.size(0):  # slice only when the batch shrinks (slicing costs backward)
                h, c = h[:active], c[:active]
                mem_t = Memory(memory.values[:active], memory.keys[:active])
                ue = use_expected[:active] if use_expected is not None else None
            h, c, z_hat, sel = self._advance(emb[:active, t], h, c, mem_t, rule, ue)
            hs.append(h)
            zs.append(z_hat)
            alphas_t.append(sel.alpha)
            if sel.log_prob is not None and sel.entropy is not None:
                log_ps_t.append(sel.log_prob)
                ents_t.append(sel.entropy)
        hs_bt, zs_bt = _stack_padded(hs, B), _stack_padded(zs, B)  # (B, T, H), (B, T, D)
        alphas = _stack_padded(alphas_t, B) if T else emb.new_zeros(B, 0, L)  # (B, T, L)
        logits = self._output(emb, hs_bt, zs_bt) if T else emb.new_zeros(B, 0, self.vocab_size)
        log_ps = _stack_padded(log_ps_t, B) if rule == "sample" and T else None  # (B, T)
        ents = _stack_padded(ents_t, B) if rule == "sample" and T else None
        if rule == "sample" and not T:
            log_ps, ents = emb.new_zeros(B, 0), emb.new_zeros(B, 0)

        out = DecoderOutput(logits, alphas, log_ps, ents, None)
        if log_ps is not None and use_expected is not None:
            out.sampled = ~use_expected
        if not is_sorted:
            inv = torch.empty_like(perm)
            inv[perm] = torch.arange(B, device=perm.device)
            out = DecoderOutput(*(None if x is None else x[inv] for x in (
                out.logits, out.alphas, out.attn_log_probs, out.attn_entropy, out.sampled)))
        return out


def _stack_padded(rows: list[Tensor], batch: int) -> Tensor:
    """Stack per-step tensors of shrinking batch (b_t, ...) into (batch, T, ...), zero padded."""
    padded = [r if r.size(0) == batch else torch.cat(
        [r, r.new_zeros(batch - r.size(0), *r.shape[1:])]) for r in rows]
    return torch.stack(padded, dim=1)
