"""LSTM decoder with attention (Xu et al. 2015, §3.1.2 and §4).

The decoder exposes three calls that every decoding strategy needs:

* `memory(features)`   projects the annotations once per image (the scorer's keys, e.g. W_a a_i);
* `init_state(memory)` gives h_0, c_0 from MLPs of the mean annotation;
* `step(tokens, state, memory)` advances one word and returns log p(y_t), the state and α_t.

`forward` is the teacher-forced pass used for training. It runs each step only on the captions
that are still going (it sorts them longest first; outputs come back in the batch's order),
and the products over every word position (the word gates, the deep output) on the real
positions only (`captioning.models.packing`), so no work is spent on padding.
With a fast path (`use_fast_path`) it instead runs every caption for a fixed number of steps
(the batch's caption width, rounded up to a multiple of `bucket`) and masks the outputs past
each caption's end: fixed shapes, so that `torch.compile` (`compile`) fuses the whole unrolled pass
and, on CUDA, `reduce-overhead` (`graphs`) replays it as CUDA graphs, one per bucket (a smaller
batch is padded with masked rows: `fast_path.FixedPass`). A pass without gradient (validation's
loss, a reference pass) runs the eager loop: the graphs are for training steps.

Hard attention is trained with sampled locations (`hard_estimator: reinforce`, §4.1) or with the
straight-through Gumbel-softmax (`gumbel`; τ follows the `GumbelSchedule` through `set_tau`,
which `captioning.callbacks.GumbelTemperature` calls every training step). Either way a caption
may use the expected context instead (semi-sampling, §4.1); with `semi_sampling_grad: paper`
(the paper and the authors' capgen.py) its likelihood's gradient reaches the scorer through α,
with `detached` it does not.

`n_layers_att` and `n_layers_init` are capgen.py's options of the same names (its COCO script
evaluate_coco.py sets both to 2): extra tanh layers on the projected annotations, and extra
ReLU layers (with dropout) on the mean annotation before the init MLPs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import captioning.models.native as native
from captioning.choices import check_choice
from captioning.models.attention import (
    GumbelSchedule,
    Normalizer,
    Selection,
    SelectRule,
    WeightRule,
    build_scorer,
    context,
    select,
)
from captioning.models.fast_path import FastPath, FixedPass, pad_rows
from captioning.models.packing import PackedSteps, StepTrace
from captioning.models.pass_grads import (
    PassGradient,
    RecurrentProduct,
    autocast_dtype,
    linear,
    linear_layer,
    lstm_pass_weights,
    onednn_is_faster,
)
from captioning.models.repeats import per_distinct_row, repeated_rows
from captioning.models.settings import (
    AttentionKind,
    HardEstimator,
    SemiSampling,
    SemiSamplingGrad,
    check_settings,
)
from captioning.models.state import DecoderState, Memory, grid_dtype


@dataclass
class DecoderOutput:
    """Teacher-forced outputs for T = max(lengths) - 1 predicted words."""

    logits: Tensor  # (B, T, V), zero past each caption's end
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
        semi_sampling_grad: SemiSamplingGrad = "paper",
        hard_estimator: HardEstimator = "reinforce",
        gumbel: GumbelSchedule | None = None,
        score: str = "additive",
        n_layers_att: int = 1,
        n_layers_init: int = 1,
        normalizer: Normalizer = "softmax",
        output_tanh: bool = False,
    ) -> None:
        super().__init__()
        check_settings(attention=attention, hard_decode=hard_decode, semi_sampling=semi_sampling,
                       semi_sampling_prob=semi_sampling_prob,
                       semi_sampling_grad=semi_sampling_grad, hard_estimator=hard_estimator,
                       n_layers_init=n_layers_init, normalizer=normalizer)
        self.normalizer: Normalizer = normalizer
        self.output_tanh = output_tanh  # capgen.py's tanh on the deep output's sum
        self.vocab_size = vocab_size
        self.attention_kind: AttentionKind = attention
        self.hard_decode: WeightRule = hard_decode
        self.semi_sampling_prob = semi_sampling_prob
        self.semi_sampling: SemiSampling = semi_sampling
        self.semi_sampling_grad: SemiSamplingGrad = semi_sampling_grad
        self.hard_estimator: HardEstimator = hard_estimator
        self.gumbel_schedule = gumbel if gumbel is not None else GumbelSchedule()
        # Gumbel-softmax temperature τ of the training pass, set every step from the schedule
        # (`set_tau`). A tensor, not in the state dict: a new value is data, so a compiled step
        # does not recompile as τ anneals.
        self.tau: Tensor
        self.register_buffer("tau", torch.tensor(self.gumbel_schedule.start), persistent=False)

        self.embed = nn.Embedding(vocab_size, embed_dim)  # E
        self.init_trunk = _init_trunk(feature_dim, n_layers_init, dropout)  # capgen ff_init_l
        self.init_h = nn.Linear(feature_dim, hidden_dim)  # f_init,h
        self.init_c = nn.Linear(feature_dim, hidden_dim)  # f_init,c
        self.attention = build_scorer(score, feature_dim=feature_dim, hidden_dim=hidden_dim,
                                      attn_dim=attn_dim, n_layers=n_layers_att)  # f_att (Eq. 4)
        self.gate = nn.Linear(hidden_dim, 1)  # f_β
        self.lstm = nn.LSTMCell(embed_dim + feature_dim, hidden_dim)  # T_{D+m+n,n}
        self.out_h = nn.Linear(hidden_dim, embed_dim)  # L_h
        self.out_z = nn.Linear(feature_dim, embed_dim, bias=False)  # L_z
        self.out = nn.Linear(embed_dim, vocab_size)  # L_o
        self.dropout = nn.Dropout(dropout)
        self.fast_path: FastPath = "off"
        self.fast_bucket = 8
        self._fixed: FixedPass | None = None  # the compiled unrolled pass

    @property
    def weight_dtype(self) -> torch.dtype:  # float32, unless the model was cast
        return self.init_h.weight.dtype

    # -- the step API -----------------------------------------------------------------------
    def memory(self, features: Tensor) -> Memory:
        """Annotations (B, L, D) and the scorer's keys (B, L, K), computed once, and once per
        distinct image where a batch repeats one (`captioning.models.repeats`). Annotations
        that need no gradient are cast once, here, for the keys' product and every step's
        context alike: to autocast's dtype, else a float16 (cached) grid to the weights' (a
        fine-tuned encoder's keep theirs, so that their gradient sums in float32)."""
        if not features.requires_grad:
            features = features.to(autocast_dtype(features) or grid_dtype(features.dtype,
                                                                           self.weight_dtype))
        return Memory(features, per_distinct_row(features, self.attention.project))

    def init_state(self, memory: Memory) -> DecoderState:
        """c_0 = f_init,c(mean a_i), h_0 = f_init,h(mean a_i) (§3.1.2)."""
        mean = memory.values.mean(dim=1)  # (B, D), or (N, D) with rows
        if memory.rows is not None:
            mean = mean.index_select(0, memory.rows)
        mean = self.init_trunk(mean)
        h = torch.tanh(self.init_h(mean))
        c = torch.tanh(self.init_c(mean))
        loc = torch.zeros(mean.size(0), dtype=torch.long, device=mean.device)
        return DecoderState(h, c, loc)

    def step(
        self, tokens: Tensor, state: DecoderState, memory: Memory
    ) -> tuple[Tensor, DecoderState, Tensor]:
        """One word: tokens y_{t-1} (B,) -> log p(y_t) (B, V), new state, α_t (B, L)."""
        emb = self.embed(tokens)  # (B, E)
        h, c, z_hat, sel = self._advance(self._word_gates(emb), state.h, state.c, memory,
                                         self.step_rule, None)
        logits = self._output(emb, h, z_hat)
        return F.log_softmax(logits.float(), dim=-1), DecoderState(h, c, sel.location), sel.alpha

    def use_fast_path(self, mode: FastPath, *, bucket: int = 8) -> None:
        """Teacher forcing over fixed shapes: `compile` (torch.compile, any device), `graphs`
        (torch.compile reduce-overhead: CUDA graphs) or `off` (the shrinking eager loop).
        Lengths are padded up to a multiple of `bucket` steps: one compiled graph per bucket.
        Passes without gradient run the eager loop.
        `native`: the eager loop with native CPU kernels (captioning.models.native: attention's
        score and context, the LSTM cell), for decoding steps too; `off` where the scorer has
        none or they cannot be built here."""
        check_choice("fast_path", mode, FastPath)
        if bucket < 1:
            raise ValueError(f"fast_path bucket must be >= 1, got {bucket}")
        native = self.attention.use_native(mode == "native")
        self.fast_path = "off" if mode == "native" and not native else mode
        self.fast_bucket = bucket
        self._fixed = None
        if mode not in ("off", "native"):
            self._fixed = FixedPass(self.teacher_forced_fixed, graphs=mode == "graphs")

    def set_tau(self, tau: float) -> None:
        """Set the Gumbel-softmax temperature τ of the training pass."""
        self.tau.fill_(tau)

    @property
    def step_rule(self) -> WeightRule:
        """The weight rule used at decoding time."""
        return "expected" if self.attention_kind == "soft" else self.hard_decode

    # -- internals -------------------------------------------------------------------------
    def _word_gates(self, emb: Tensor, w: Tensor | None = None, onednn: bool = False) -> Tensor:
        """The LSTM gates' part from the previous word, with both biases: (..., E) -> (..., 4H).
        Teacher forcing's for every step at once, by its `w` (4H, E) (`_pass_weights`)."""
        w = self.lstm.weight_ih[:, : emb.size(-1)] if w is None else w  # (4H, E)
        return linear(emb, w, self.lstm.bias_ih + self.lstm.bias_hh, onednn=onednn)

    def _pass_weights(self) -> tuple[Tensor, Tensor]:
        """The LSTM's word weight (4H, E) and [W_z | W_hh]^T (D + H, 4H), the gates' part from
        ẑ_t and h_{t-1} in one product a step; built once a pass, so that the latter's gradient
        is summed over the steps before it is split (`lstm_pass_weights`)."""
        return lstm_pass_weights(self.lstm.weight_ih, self.lstm.weight_hh,
                                 self.embed.embedding_dim)

    def _advance(self, word_gates: Tensor, h: Tensor, c: Tensor, memory: Memory,
                 rule: SelectRule, recurrent: RecurrentProduct | None,
                 use_expected: Tensor | None = None, keys_grad: PassGradient | None = None,
                 query: RecurrentProduct | None = None
                 ) -> tuple[Tensor, Tensor, Tensor, Selection]:
        """One step from `word_gates` (b, 4H) and the state (b, H): h, c, ẑ_t and the selection.
        `recurrent`: by [W_z | W_hh]^T (`_pass_weights`), made once by a teacher-forced pass;
        None for one word (decoding), which multiplies by the two weights apart instead.
        `keys_grad`, `query`: the pass's sums of the keys' and W_q's gradients (the scorer's)."""
        # e_ti = f_att(a_i, h_{t-1}) (Eq. 4)
        scores = self.attention(memory.keys, h, keys_grad=keys_grad, rows=memory.rows,
                                query=query)
        sel = select(scores, rule, tau=self.tau, normalizer=self.normalizer)  # α_t (Eq. 5)
        weights = sel.weights
        if use_expected is not None:
            # Semi-sampling (§4.1): these captions use the expected context, s̃_t = α_t. `paper`
            # keeps α differentiable (capgen.py), so the likelihood trains the scorer through
            # these captions; `detached` leaves the scorer to REINFORCE and entropy terms.
            alpha = sel.alpha if self.semi_sampling_grad == "paper" else sel.alpha.detach()
            weights = torch.where(use_expected.unsqueeze(1), alpha, weights)
        z = context(weights, memory.values, memory.rows, wide=self.weight_dtype)  # Eq. 6
        beta = torch.sigmoid(self.gate(h))  # β_t = σ(f_β(h_{t-1})) (§4.2.1)
        z_hat = beta * z  # (B, D)
        # Eqs. 1-3, the LSTM (nn.LSTMCell's weights and gate order i, f, g, o)
        if recurrent is None:
            E = self.embed.embedding_dim
            gates = torch.addmm(word_gates, z_hat, self.lstm.weight_ih[:, E:].t())
            gates = torch.addmm(gates, h, self.lstm.weight_hh.t())  # (b, 4H)
        else:
            gates = recurrent(word_gates, torch.cat([z_hat, h], dim=1))  # (b, 4H)
        h, c = native.lstm_cell(gates, c, kernel=self.fast_path == "native")
        return h, c, z_hat, sel

    def _output(self, emb: Tensor, h: Tensor, z_hat: Tensor, *,
                dropout: Callable[[Tensor], Tensor] | None = None, onednn: bool = False
                ) -> Tensor:
        """Deep output: p(y_t) ∝ exp(L_o(E y_{t-1} + L_h h_t + L_z ẑ_t)) (Eq. 7, as printed;
        with `output_tanh`, capgen.py's L_o(tanh(...))). `dropout`: in place of `self.dropout`
        (the packed pass's, `PackedSteps.dropout`). `onednn`: by oneDNN (`linear_layer`)."""
        drop = self.dropout if dropout is None else dropout
        x = (emb + linear_layer(self.out_h, drop(h), onednn=onednn)
             + linear_layer(self.out_z, z_hat, onednn=onednn))
        x = drop(torch.tanh(x) if self.output_tanh else x)
        return linear_layer(self.out, x, onednn=onednn)

    def _training_rule(self) -> tuple[SelectRule, bool]:
        """(rule, semi-sample?) for the teacher-forced pass."""
        if self.attention_kind == "soft":
            return "expected", False
        if self.training:
            return ("gumbel" if self.hard_estimator == "gumbel" else "sample"), True
        return self.hard_decode, False

    def _semi_sampling_coin(self, batch: int, device: torch.device) -> Tensor:
        """True where a caption uses the expected context: per image, or one coin per batch."""
        n = batch if self.semi_sampling == "image" else 1
        coin = torch.rand(n, device=device) < self.semi_sampling_prob
        return coin.expand(batch) if n == 1 else coin

    # -- teacher forcing -------------------------------------------------------------------
    def forward(self, features: Tensor, captions: Tensor, lengths: Tensor, *,
                rule: SelectRule | None = None) -> DecoderOutput:
        """features (B, L, D), float16 for a cached grid (read as the float32 values it holds);
        captions (B, T+1) starting with <start>; lengths (B,) incl. specials.

        `rule` forces one weight rule for every caption (no semi-sampling); by default soft
        uses the expected context, and hard samples while training and decodes otherwise.
        """
        steps = (lengths - 1).clamp_min(0)  # words to predict per caption
        rule, semi = self._training_rule() if rule is None else (rule, False)
        if self._fixed is not None and captions.size(1) > 1 and torch.is_grad_enabled():
            features = features.to(grid_dtype(features.dtype, self.weight_dtype))
            return self._forward_fixed(features, captions, steps, rule, semi)
        steps_cpu = steps.tolist()
        # The loop runs the captions longest first; outputs come back in the batch's order.
        order = sorted(range(len(steps_cpu)), key=lambda i: -steps_cpu[i])
        perm = None if order == list(range(len(order))) else torch.tensor(
            order, device=captions.device)
        if perm is not None:
            steps_cpu = [steps_cpu[i] for i in order]
        B, T = captions.size(0), max(steps_cpu, default=0)
        if not T:
            return self._no_words(features, B, rule, semi)
        pk = PackedSteps.of(steps_cpu, rows=order, device=captions.device)

        memory, state = self._pass_start(features, perm)
        h, c = state.h, state.c
        emb = self.embed(pk.gather(captions[:, :T]))  # (N, E): inputs y_0 .. y_{T-1}, packed
        use_expected = self._semi_sampling_coin(B, features.device) if semi else None

        trace = StepTrace()  # below: (b_t, 4H) a step; split, one backward node
        word_w, recurrent_w = self._pass_weights()
        native = self.fast_path == "native"
        fast = native and onednn_is_faster()  # the rest by oneDNN where it is the faster
        word_gates = self._word_gates(emb, word_w, fast).split(pk.running)
        # Gradients of W, W_q and the keys, summed over the steps in one place (pass_grads)
        recurrent = RecurrentProduct(recurrent_w, onednn=native)
        keys, keys_grad = PassGradient.through(memory.keys)
        query = self.attention.query_product(onednn=fast)
        mem_t = memory = memory._replace(keys=keys)
        ue = use_expected
        for t, active in enumerate(pk.running):  # captions sorted longest first: b_t shrinks
            if active < h.size(0):  # slice only when the batch shrinks (slicing costs backward)
                h, c = h[:active], c[:active]
                # The scorer reads the keys' first `active` rows (or those of `rows[:active]`)
                # itself: a sliced keys tensor would cost a zero-filled (B, L, K) gradient per
                # slice in backward.
                mem_t = memory.first(active)
                ue = use_expected[:active] if use_expected is not None else None
            h, c, z_hat, sel = self._advance(word_gates[t], h, c, mem_t, rule, recurrent, ue,
                                             keys_grad, query)
            trace.add(h, z_hat, sel)
        # The deep output on the N real positions only, its dropout masks drawn for (B, T)
        logits = pk.scatter(self._output(  # (B, T, V), zero past each caption's end
            emb, torch.cat(trace.hs), torch.cat(trace.zs),
            dropout=pk.dropout(self.dropout.p, self.dropout.training), onednn=fast))
        alphas = pk.padded(trace.alphas)  # (B, T, L)
        sampling = rule in ("sample", "gumbel")  # a location per step: log p(s_t | a) and H
        log_ps = pk.padded(trace.log_ps) if sampling else None  # (B, T)
        ents = pk.padded(trace.ents) if sampling else None

        out = DecoderOutput(logits, alphas, log_ps, ents, None)
        if log_ps is not None and use_expected is not None:
            out.sampled = ~use_expected if perm is None else torch.empty_like(
                use_expected).index_copy_(0, perm, ~use_expected)
        return out

    def _pass_start(self, features: Tensor, perm: Tensor | None
                    ) -> tuple[Memory, DecoderState]:
        """The memory and initial state of a teacher-forced pass whose captions run in `perm`'s
        order (None: the batch's). On the native path, for a grid without gradient: one row per
        distinct image (`models.repeats`), read by its captions through `rows`, so that neither
        grid nor keys is copied per caption. Else `memory` of the reordered batch."""
        dtype = autocast_dtype(features)  # cast once, for the keys and every step's context
        wide = grid_dtype(features.dtype, self.weight_dtype)  # a float16 grid's float32
        if (self.fast_path != "native" or features.device.type != "cpu"
                or (dtype or wide) not in native.DTYPES
                or (features.requires_grad and torch.is_grad_enabled())):
            memory = self.memory(features if perm is None else features[perm])
            return memory, self.init_state(memory)
        found = repeated_rows(features)
        rows = torch.arange(features.size(0)) if found is None else found[1]
        features = features if found is None else features.index_select(0, found[0])
        rows = rows if perm is None else rows.index_select(0, perm)
        features = features if dtype is None else features.to(dtype)
        computed = features.to(dtype or wide)  # the keys' product and h_0, c_0 read it
        memory = Memory(computed, self.attention.project(computed, onednn=True), rows)
        # A float16 grid stays so for every step's context: half the bytes to read
        return memory._replace(values=features), self.init_state(memory)

    def _no_words(self, features: Tensor, B: int, rule: SelectRule, semi: bool
                  ) -> DecoderOutput:
        """`forward` of a batch with no word to predict: outputs with T = 0."""
        sampling = rule in ("sample", "gumbel")
        zeros = self.embed.weight.new_zeros
        out = DecoderOutput(zeros(B, 0, self.vocab_size), zeros(B, 0, features.size(1)),
                            zeros(B, 0) if sampling else None, zeros(B, 0) if sampling else None)
        if sampling and semi:
            out.sampled = ~self._semi_sampling_coin(B, features.device)
        return out

    def _forward_fixed(self, features: Tensor, captions: Tensor, steps: Tensor,
                       rule: SelectRule, semi: bool) -> DecoderOutput:
        """`forward` through the compiled fixed-shape pass: T padded up to the bucket. T is the
        captions' width - 1, not read from `steps`, so that no step waits for the GPU; columns
        past the longest caption (a batch padded wider) are masked like any padding."""
        assert self._fixed is not None
        T = captions.size(1) - 1
        padded = -(-T // self.fast_bucket) * self.fast_bucket  # T rounded up to the bucket
        tokens = captions[:, :padded]  # made contiguous by pad_rows, as every input
        if tokens.size(1) < padded:  # the pad id never reaches an output: those steps are masked
            tokens = F.pad(tokens, (0, padded - tokens.size(1)))
        B = captions.size(0)
        use_expected = self._semi_sampling_coin(B, features.device) if semi else None
        mask = torch.arange(padded, device=steps.device) < steps.unsqueeze(1)  # (B, T')
        rows = self._fixed.rows(B)  # a smaller batch: masked rows added
        outs = self._fixed(*(pad_rows(x, rows) for x in (features, tokens, mask, use_expected)),
                           rule)
        # Outputs are cut back to B rows and T steps. Graph outputs live in memory the next
        # replay overwrites: `graphs` hands out copies.
        cut = [None if x is None else x[:B, :T] for x in outs]
        if self.fast_path == "graphs":
            cut = [None if x is None else x.clone() for x in cut]
        out = DecoderOutput(*cut)  # type: ignore[arg-type]
        if out.attn_log_probs is not None and use_expected is not None:
            out.sampled = ~use_expected
        return out

    def teacher_forced_fixed(self, features: Tensor, tokens: Tensor, mask: Tensor,
                             use_expected: Tensor | None, rule: SelectRule
                             ) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None]:
        """Every caption for all T steps of `tokens` (B, T) with `mask` (B, T) True where a
        word is predicted, `use_expected` (B,) or None as `_advance` takes it: logits (B, T, V)
        and α (B, T, L), zero past each caption's end as in `forward`, then log p(s_t) and
        H[α_t] (B, T) for the sampling rules. Fixed shapes."""
        memory = Memory(features, self.attention.project(features))  # compiled: no host read
        state = self.init_state(memory)
        h, c = state.h, state.c
        emb = self.embed(tokens)  # (B, T, E)
        trace = StepTrace()
        word_w, recurrent_w = self._pass_weights()
        word_gates = self._word_gates(emb, word_w).unbind(1)  # T x (B, 4H)
        recurrent = RecurrentProduct(recurrent_w, defer=False)  # compiled
        for t in range(tokens.size(1)):
            h, c, z_hat, sel = self._advance(word_gates[t], h, c, memory, rule, recurrent,
                                             use_expected)
            trace.add(h, z_hat, sel)
        m = mask.unsqueeze(-1)  # (B, T, 1); `where`, not a product: past the end stays 0
        alpha = torch.where(m, torch.stack(trace.alphas, 1), 0.0)  # (B, T, L)
        # h_t and ẑ_t past the end reach nothing: the logits there are masked, gradient too
        logits = torch.where(m, self._output(emb, torch.stack(trace.hs, 1),
                                             torch.stack(trace.zs, 1)), 0.0)  # (B, T, V)
        if not trace.log_ps:
            return logits, alpha, None, None
        return (logits, alpha, torch.where(mask, torch.stack(trace.log_ps, 1), 0.0),
                torch.where(mask, torch.stack(trace.ents, 1), 0.0))


def _init_trunk(dim: int, n_layers: int, dropout: float) -> nn.Sequential:
    """capgen.py's `n_layers_init`: n − 1 layers ReLU(W_l x + b_l) with dropout on the mean
    annotation, shared by f_init,h and f_init,c. Empty, without parameters, for n = 1."""
    layers: list[nn.Module] = []
    for _ in range(n_layers - 1):
        layers += [nn.Linear(dim, dim), nn.ReLU(), nn.Dropout(dropout)]
    return nn.Sequential(*layers)
