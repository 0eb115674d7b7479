"""The CPU training step's kernels: the fused additive score (`AdditiveScore`) and the decoder's
LSTM over precomputed word gates. Both must give what the plain formulas give: the same
scores, loss and every gradient to 1e-5."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from conftest import decoder_and_batch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from captioning.models.attention import AdditiveAttention, AdditiveScore
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.pass_grads import PassGradient


def reference_score(keys: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """w^T tanh(k_i + q) with autograd's ops, on the first q.size(0) rows of the keys."""
    return torch.tanh(keys[: q.size(0)] + q.unsqueeze(1)) @ w[0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("b", [5, 3], ids=["all-rows", "first-rows"])
def test_fused_score_equals_the_formula_and_its_gradients(b: int, dtype: torch.dtype) -> None:
    """Every key row, and the first 3 of 5 (captions that ended)."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(5, 49, 32, generator=g, dtype=dtype) * 2
    q = torch.randn(b, 32, generator=g, dtype=dtype)
    w = torch.randn(1, 32, generator=g, dtype=dtype)
    weight = torch.randn(b, 49, generator=g, dtype=dtype)  # every score weighs differently
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    outs = []
    for fn in (reference_score, fused, fused_summed):
        k, qq, ww = (x.clone().requires_grad_() for x in (keys, q, w))
        e = fn(k, qq, ww)
        (F.softmax(e, -1) * weight).sum().backward()
        outs.append((e.detach(), k.grad, qq.grad, ww.grad))
    for other in outs[1:]:
        for ref, got, name in zip(outs[0], other, ("scores", "keys grad", "query grad", "w grad")):
            assert got.shape == ref.shape, name
            torch.testing.assert_close(got, ref, rtol=tol, atol=tol, msg=name)
        assert bool(other[1][b:].eq(0).all())  # rows past the running captions: no gradient


def fused(keys: Tensor, q: Tensor, w: Tensor) -> Tensor:
    return AdditiveScore.apply(keys, q, w, None)


def fused_summed(keys: Tensor, q: Tensor, w: Tensor) -> Tensor:
    """The fused score with the keys' gradient summed in place (`PassGradient`), as the
    decoder's teacher-forced pass runs it."""
    keys, sink = PassGradient.through(keys)
    return AdditiveScore.apply(keys, q, w, sink)


@pytest.mark.parametrize("fn", [fused, fused_summed])
def test_fused_score_backs_up_twice_through_a_retained_graph(
        fn: Callable[[Tensor, Tensor, Tensor], Tensor]) -> None:
    keys, q, w = (torch.randn(*s, requires_grad=True) for s in ((2, 3, 4), (2, 4), (1, 4)))
    e = fn(keys, q, w).sum()
    e.backward(retain_graph=True)
    first = keys.grad.clone()
    e.backward()
    torch.testing.assert_close(keys.grad, 2 * first)


def test_additive_attention_uses_the_fused_score_on_the_cpu() -> None:
    torch.manual_seed(0)
    att = AdditiveAttention(feature_dim=8, hidden_dim=6, attn_dim=7)
    keys, h = att.project(torch.randn(4, 9, 8)), torch.randn(3, 6)
    e = att(keys, h)
    assert e.grad_fn is not None and "AdditiveScore" in type(e.grad_fn).__name__
    ref = att.score(torch.tanh(keys[:3] + att.query(h).unsqueeze(1))).squeeze(-1)
    torch.testing.assert_close(e, ref, rtol=1e-5, atol=1e-6)


def reference_loss(dec: AttentionLSTMDecoder, feats: Tensor, caps: Tensor,
                   lengths: Tensor) -> Tensor:
    """The teacher-forced loss written out with nn.LSTMCell and the plain tanh score: every
    caption runs every step, padding is masked out of the loss, and dropout (in training mode)
    is drawn over the whole padded (B, T) batch."""
    keys = dec.attention.project(feats)
    mean = feats.mean(1)
    h, c = torch.tanh(dec.init_h(mean)), torch.tanh(dec.init_c(mean))
    T = int(lengths.max()) - 1
    att, embs, hs, zs = dec.attention, [], [], []
    for t in range(T):
        emb = dec.embed(caps[:, t])
        e = att.score(torch.tanh(keys + att.query(h).unsqueeze(1))).squeeze(-1)
        z = torch.bmm(F.softmax(e, -1).unsqueeze(1), feats).squeeze(1)
        z_hat = torch.sigmoid(dec.gate(h)) * z
        h, c = dec.lstm(torch.cat([emb, z_hat], 1), (h, c))
        embs.append(emb), hs.append(h), zs.append(z_hat)
    emb, h, z_hat = (torch.stack(x, 1) for x in (embs, hs, zs))  # (B, T, ...)
    logits = dec.out(dec.dropout(emb + dec.out_h(dec.dropout(h)) + dec.out_z(z_hat)))
    return masked_loss(logits, caps, lengths)


def masked_loss(logits: Tensor, caps: Tensor, lengths: Tensor) -> Tensor:
    """Cross-entropy of logits (B, T, V) over each caption's words only, in float32."""
    T = logits.size(1)
    mask = torch.arange(T) < (lengths - 1).unsqueeze(1)
    return F.cross_entropy(logits[mask].float(), caps[:, 1: T + 1][mask])


@pytest.mark.parametrize("grouped,dims,dropout", [
    (False, (10, 49, 24, 20), 0.0), (True, (10, 49, 24, 20), 0.0),
    (False, (32, 196, 512, 512), 0.0), (True, (32, 196, 512, 512), 0.0),
    (False, (10, 49, 24, 20), 0.5), (True, (32, 196, 512, 512), 0.5)],
    ids=["small-own-images", "small-five-per-image", "issue17-size-own-images",
         "issue17-size-five-per-image", "small-dropout", "issue17-size-dropout"])
def test_decoder_loss_and_gradients_equal_the_reference(dims: tuple[int, int, int, int],
                                                        grouped: bool, dropout: float) -> None:
    """The decoder's loss and every gradient equal the plain formulas', with an image per
    caption and with five captions per image; with dropout, its masks are those nn.Dropout
    draws over the padded batch from the same seed, though the decoder skips the padding."""
    dec, feats, caps, lengths, _ = decoder_and_batch(dims, dropout, grouped=grouped)
    grads = []
    for run in ("decoder", "reference"):
        dec.zero_grad()
        torch.manual_seed(3)  # the same dropout masks in both
        if run == "decoder":
            loss = masked_loss(dec(feats, caps, lengths).logits, caps, lengths)
        else:
            loss = reference_loss(dec, feats, caps, lengths)
        loss.backward()
        grads.append((loss.detach(), {n: p.grad.clone() for n, p in dec.named_parameters()
                                      if p.grad is not None}))
    (loss_a, ga), (loss_b, gb) = grads
    assert abs(loss_a.item() - loss_b.item()) <= 1e-5
    assert ga.keys() == gb.keys() and len(ga) == len(list(dec.parameters()))
    for name in ga:
        torch.testing.assert_close(ga[name], gb[name], rtol=1e-4, atol=1e-5, msg=name)


def test_step_by_step_decoding_equals_the_teacher_forced_pass() -> None:
    """`step` (one word, the two recurrent weights apart) gives the teacher-forced pass's
    log-probabilities and attention (one product with the weights joined), word by word."""
    torch.manual_seed(0)
    dec = AttentionLSTMDecoder(vocab_size=40, feature_dim=24, embed_dim=16, hidden_dim=20,
                               attn_dim=12, dropout=0.0).eval()
    g = torch.Generator().manual_seed(3)
    feats = torch.randn(4, 49, 24, generator=g)
    caps = torch.randint(4, 40, (4, 9), generator=g)
    lengths = torch.full((4,), 9)
    with torch.no_grad():
        out = dec(feats, caps, lengths)
        memory = dec.memory(feats)
        state = dec.init_state(memory)
        for t in range(8):
            log_p, state, alpha = dec.step(caps[:, t], state, memory)
            torch.testing.assert_close(log_p, F.log_softmax(out.logits[:, t], -1),
                                       rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(alpha, out.alphas[:, t], rtol=1e-5, atol=1e-6)


class _MixedDtypes(TorchDispatchMode):
    """Records the ops over tensors of at least `big` entries whose floating tensors are not
    all of one dtype (casts aside)."""

    def __init__(self, big: int) -> None:
        super().__init__()
        self.big, self.mixed, self.seen = big, [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        kwargs = kwargs or {}
        floats = [a for a in tree_leaves((args, kwargs)) if isinstance(a, Tensor)
                  and a.dim() > 0 and a.is_floating_point()]
        cast = func in (torch.ops.aten._to_copy.default, torch.ops.aten.copy_.default)
        if not cast and any(a.numel() >= self.big for a in floats):
            self.seen += 1
            if len({a.dtype for a in floats}) > 1:
                self.mixed.append(str(func))
        return func(*args, **kwargs)


def test_under_bf16_autocast_the_score_mixes_no_dtypes_over_the_grid() -> None:
    """On the CPU an elementwise op over (b, L, A) with bf16 and float32 operands runs about 30x
    slower than one in a single dtype: under bf16 autocast (as Lightning's `bf16-mixed`) the
    score's forward and backward have none, and its gradients stay close to float32's."""
    torch.manual_seed(0)
    att = AdditiveAttention(feature_dim=8, hidden_dim=6, attn_dim=7)
    feats, h = torch.randn(4, 9, 8), torch.randn(3, 6)
    weight = torch.randn(3, 9)
    grads = []
    for bf16 in (False, True):
        att.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            keys = att.project(feats)
            seen, sink = PassGradient.through(keys)
            with _MixedDtypes(big=3 * 9 * 7) as record:
                e = att(seen, h, keys_grad=sink)
        with record:
            (F.softmax(e.float(), -1) * weight).sum().backward()
        assert keys.dtype == (torch.bfloat16 if bf16 else torch.float32)
        assert record.mixed == [] and record.seen >= 5, (record.mixed, record.seen)
        grads.append([p.grad.clone() for p in att.parameters()])
    for ref, got in zip(*grads):
        torch.testing.assert_close(got, ref, rtol=5e-2, atol=5e-2)


@pytest.mark.parametrize("shift", [0.0, 0.3], ids=["initial-w", "large-sum-of-w"])
def test_under_bf16_autocast_the_attention_is_as_accurate_as_the_plain_scores(
        shift: float) -> None:
    """e = 2 wᵀs − Σw: in bf16 the shift Σw must not cost the scores their precision, also
    when Σw is large (w's entries shifted by 0.3: Σw ≈ 150). α against float64, under bf16
    autocast, the fused score against the plain formula."""
    torch.manual_seed(0)
    att = AdditiveAttention(feature_dim=64, hidden_dim=32, attn_dim=512)
    with torch.no_grad():
        att.score.weight += shift
    feats, h = torch.randn(8, 196, 64), torch.randn(8, 32)
    with torch.no_grad():
        truth = F.softmax(att.double().score(torch.tanh(
            att.project(feats.double()) + att.query(h.double()).unsqueeze(1))).squeeze(-1), -1)
    att.float()
    errors = {}
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
        keys = att.project(feats)
        fused = att(keys, h)
        plain = att.score(torch.tanh(keys + att.query(h).unsqueeze(1))).squeeze(-1)
    for name, e in (("fused", fused), ("plain", plain)):
        errors[name] = float((F.softmax(e.double(), -1) - truth).abs().sum(-1).mean())
    assert errors["fused"] <= 1.5 * errors["plain"] + 1e-3, errors


@pytest.mark.parametrize("dims", [(10, 49, 24, 20), (32, 196, 512, 512)],
                         ids=["small", "issue17-size"])
def test_under_bf16_autocast_the_decoder_is_as_accurate_as_autocasts_plain_ops(
        dims: tuple[int, int, int, int]) -> None:
    """Under CPU bf16 autocast (as Lightning's `bf16-mixed` runs it) the decoder's loss and
    gradients stay as close to the float32 truth as the plain formulas' under the same
    autocast: the once-a-pass casts and the score in bf16 lose nothing."""
    B, L, D, H = dims
    torch.manual_seed(0)
    dec = AttentionLSTMDecoder(vocab_size=40, feature_dim=D, embed_dim=H, hidden_dim=H,
                               attn_dim=H, dropout=0.0)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(B, L, D, generator=g).relu()
    lengths = torch.randint(4, 15, (B,), generator=g)
    caps = torch.randint(4, 40, (B, 15), generator=g)
    runs = {}
    for run, bf16 in (("truth", False), ("plain", True), ("decoder", True)):
        dec.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16, cache_enabled=False):
            if run == "decoder":
                loss = masked_loss(dec(feats, caps, lengths).logits, caps, lengths)
            else:
                loss = reference_loss(dec, feats, caps, lengths)
        loss.float().backward()
        runs[run] = (loss.item(), {n: p.grad.clone() for n, p in dec.named_parameters()
                                   if p.grad is not None})
    truth_loss, truth = runs["truth"]
    errors = {}
    for run in ("plain", "decoder"):
        loss, grads = runs[run]
        assert abs(loss - truth_loss) < 1e-3, run
        assert grads.keys() == truth.keys() and len(grads) == len(list(dec.parameters()))
        errors[run] = {n: float((grads[n].float() - truth[n]).norm() / truth[n].norm())
                       for n in truth}
    assert max(errors["decoder"].values()) < 0.03, errors["decoder"]
    assert max(errors["decoder"].values()) <= max(errors["plain"].values()) + 0.005
