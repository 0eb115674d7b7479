"""The native CPU kernels of the additive score and the context (`captioning.models.native`):
equal to the plain formulas and to the ATen-ops path, with captions sharing grid rows too, in the
decoder as well, and safe to build: a build killed halfway does not block the next, and a
machine that cannot build them trains with the ATen ops."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from conftest import decoder_and_batch
from torch import Tensor

import captioning.models.decoder as decoder_module
from captioning.models import native, pass_grads
from captioning.models.attention import AdditiveAttention, AdditiveScore, context
from captioning.models.decoder import AttentionLSTMDecoder
from captioning.models.decoding import beam_search, greedy_search, sample_search
from captioning.models.fast_path import resolve_fast_path
from captioning.models.pass_grads import PassGradient
from captioning.models.state import Memory

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def built() -> None:
    """The kernel, which must build wherever there is a C++ compiler."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("no C++ compiler: the native kernel cannot be built here")
    assert native.available(), "the native kernel did not build on this machine"


def score_and_grads(fn: str, keys: Tensor, q: Tensor, w: Tensor, g: Tensor, *,
                    summed: bool, rows: Tensor | None = None) -> tuple[Tensor, ...]:
    """Scores and the gradients of keys, q and w for the upstream gradient g; caption c reads
    keys[rows[c]] (None: keys[c])."""
    k, qq, ww = (x.clone().requires_grad_() for x in (keys, q, w))
    kin, sink = PassGradient.through(k) if summed else (k, None)
    if fn == "formula":
        read = kin[: q.size(0)] if rows is None else kin[rows]
        e = torch.tanh(read + qq.unsqueeze(1)) @ ww[0]
    elif fn == "native":
        e = native.NativeAdditiveScore.apply(kin, qq, ww, sink, rows)
    else:  # the ATen ops, on each caption's keys gathered
        e = AdditiveScore.apply(kin if rows is None else kin[rows], qq, ww,
                                sink if rows is None else None)
    e.backward(g)
    return e.detach(), k.grad, qq.grad, ww.grad


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("A", [64, 37], ids=["vector-width", "with-a-tail"])
@pytest.mark.parametrize("b", [5, 3], ids=["all-rows", "first-rows"])
@pytest.mark.parametrize("summed", [False, True], ids=["own-gradient", "summed-over-the-pass"])
def test_native_score_equals_the_formula_and_its_gradients(A: int, b: int, summed: bool) -> None:
    """float32 kernel against the formula in float64, to 1e-5; rows past b get no gradient."""
    g = torch.Generator().manual_seed(0)
    keys = torch.randn(5, 49, A, generator=g) * 2
    q, w = torch.randn(b, A, generator=g), torch.randn(1, A, generator=g)
    up = torch.randn(b, 49, generator=g)
    ref = score_and_grads("formula", *(x.double() for x in (keys, q, w, up)), summed=False)
    got = score_and_grads("native", keys, q, w, up, summed=summed)
    for r, x, name in zip(ref, got, ("scores", "keys grad", "query grad", "w grad")):
        assert x.dtype == torch.float32 and x.shape == r.shape, name
        torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-5, msg=name)
    assert bool(got[1][b:].eq(0).all())


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("A", [64, 37], ids=["vector-width", "with-a-tail"])
@pytest.mark.parametrize("summed", [False, True], ids=["own-gradient", "summed-over-the-pass"])
def test_captions_sharing_key_rows_score_as_the_formula(A: int, summed: bool,
                                                        dtype: torch.dtype) -> None:
    """Captions reading keys through `rows` (three of one image, one alone, one row unread):
    scores and gradients equal to the formula over the gathered keys, in float64, to 1e-5; each
    row's gradient is the sum over its captions, the unread row gets none. In bf16 keys, as
    near the formula as the ATen ops on each caption's keys."""
    g = torch.Generator().manual_seed(3)
    keys = torch.randn(4, 49, A, generator=g) * 2
    rows = torch.tensor([2, 0, 2, 3, 2])
    q, w = torch.randn(5, A, generator=g), torch.randn(1, A, generator=g)
    up = torch.randn(5, 49, generator=g)
    ref = score_and_grads("formula", *(x.double() for x in (keys, q, w, up)), summed=False,
                          rows=rows)
    low = [x.to(dtype) for x in (keys, q)]
    got = score_and_grads("native", *low, w, up, summed=summed, rows=rows)
    names = ("scores", "keys grad", "query grad", "w grad")
    if dtype == torch.float32:
        for r, x, name in zip(ref, got, names):
            assert x.dtype == torch.float32 and x.shape == r.shape, name
            torch.testing.assert_close(x.double(), r, rtol=1e-5, atol=1e-5, msg=name)
    else:
        aten = score_and_grads("ops", *low, w, up, summed=False, rows=rows)
        for r, x, y, name in zip(ref, got, aten, names):
            err_ours, err_aten = ((t.double() - r).abs().max().item() for t in (x, y))
            assert x.dtype == y.dtype and err_ours <= 1.1 * err_aten + 1e-6, (name, err_ours,
                                                                             err_aten)
    assert bool(got[1][1].eq(0).all()) and bool(got[1][2].ne(0).any())


@pytest.mark.usefixtures("built")
def test_a_nan_key_gives_a_nan_score_wherever_it_lies() -> None:
    """A NaN in the keys reaches the scores (and so the loss's finite check), in a vector body
    or in a tail: the kernel's tanh clamps its argument, in a way that must keep NaN. Huge and
    infinite keys saturate it to ±1, as tanh does."""
    keys, q, w = torch.randn(2, 3, 37), torch.randn(2, 37), torch.randn(1, 37)
    keys[0, 1, 5] = float("nan")  # in the first vector chunk
    keys[1, 2, 36] = float("nan")  # in the tail
    e = native.NativeAdditiveScore.apply(keys, q, w, None, None)
    assert e.isnan().nonzero().tolist() == [[0, 1], [1, 2]]
    signs = torch.tensor([1.0, -1.0]).repeat(19)[:37]
    huge = torch.stack([signs * 1e30, signs * float("inf")]).unsqueeze(1)  # (2, 1, 37)
    e = native.NativeAdditiveScore.apply(huge, q, w, None, None)
    torch.testing.assert_close(e, (w * signs).sum().expand(2, 1), rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("at", [0, 36], ids=["vector-body", "tail"])
def test_the_kernels_tanh_is_within_4_ulp_and_never_past_one(at: int) -> None:
    """With w one-hot, the score is the kernel's tanh itself: over [-10, 10] it stays in
    [-1, 1] (so 1 - t² is never negative) and within 4 float32 ulp of tanh near ±1."""
    x = torch.linspace(-10, 10, 40_001)
    keys = x.view(1, -1, 1).expand(1, x.numel(), 37).contiguous()
    w = torch.zeros(37)
    w[at] = 1.0
    t = native.NativeAdditiveScore.apply(keys, torch.zeros(1, 37), w.view(1, 37), None, None)[0]
    assert float(t.max()) == 1.0 and float(t.min()) == -1.0
    assert float((t.double() - torch.tanh(x.double())).abs().max()) <= 4 * 2.0**-24 + 1e-12


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 37], ids=["vector-width", "with-a-tail"])
def test_the_context_kernel_equals_the_weighted_sum(D: int, dtype: torch.dtype) -> None:
    """z_c = Σ_i w_ci a_{rows[c], i} and the weights' gradient, against the formula in float64:
    to 1e-5 in float32; in bf16 annotations, z rounded once to bf16."""
    g = torch.Generator().manual_seed(5)
    values = torch.randn(4, 49, D, generator=g).relu().to(dtype)
    for rows in (torch.tensor([2, 0, 2, 3, 2]), None):
        weights = torch.softmax(torch.randn(5 if rows is not None else 3, 49, generator=g), -1)
        up = torch.randn(weights.size(0), D, generator=g)
        w64 = weights.double().requires_grad_()
        read = values.double()[: weights.size(0)] if rows is None else values.double()[rows]
        ref = torch.bmm(w64.unsqueeze(1), read).squeeze(1)
        ref.backward(up.double())
        w32 = weights.clone().requires_grad_()
        z = native.NativeContext.apply(w32, values, rows)
        z.backward(up.to(z.dtype))
        assert z.dtype == dtype and w32.grad is not None and w32.grad.dtype == torch.float32
        tol = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(z.double(), ref.detach(), rtol=tol, atol=tol)
        grad_tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the upstream rounded too
        torch.testing.assert_close(w32.grad.double(), w64.grad, rtol=grad_tol, atol=grad_tol)
    with pytest.raises(ValueError, match="no gradient of the annotations"):
        native.NativeContext.apply(weights, values.float().requires_grad_(), None)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("D", [64, 37], ids=["vector-width", "with-a-tail"])
def test_the_context_kernel_reads_a_float16_grid_as_the_float32_it_holds(D: int) -> None:
    """A cached float16 grid: z (float32) and the weights' gradient equal, to the bit, those of
    the same grid in float32; the ATen fallback (no `rows`) gives float32 too."""
    g = torch.Generator().manual_seed(6)
    half = (torch.randn(4, 49, D, generator=g) * 3).half()
    rows = torch.tensor([2, 0, 2, 3, 2])
    weights = torch.softmax(torch.randn(5, 49, generator=g), -1)
    up = torch.randn(5, D, generator=g)
    got = []
    for values in (half, half.float()):
        w = weights.clone().requires_grad_()
        z = native.NativeContext.apply(w, values, rows)
        z.backward(up)
        got.append((z, w.grad))
    (z16, dw16), (z32, dw32) = got
    assert z16.dtype == torch.float32 and torch.equal(z16, z32) and torch.equal(dw16, dw32)
    fallback = context(weights, half[rows])  # (b, L, D), one row a caption
    assert fallback.dtype == torch.float32
    torch.testing.assert_close(fallback, z32, rtol=1e-6, atol=1e-6)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("mode", ["native", "off"])
@pytest.mark.parametrize("grouped", [False, True], ids=["distinct", "by-image"])
@pytest.mark.parametrize("attention,bf16", [("soft", False), ("hard", False), ("soft", True)],
                         ids=["soft", "hard-sampled", "soft-bf16-autocast"])
def test_the_pass_reads_a_float16_grid_as_float32_to_the_bit(
        mode: str, grouped: bool, attention: str, bf16: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The teacher-forced pass of a cached float16 grid (`Captioner.encode(keep_half=True)`)
    equals the pass of the same grid in float32: logits, α and every gradient, to the bit,
    with hard attention's sampled locations and under bf16 autocast too. On the native path
    in float32 the context kernel reads the float16 grid itself (D = 40: a vector body and a
    tail)."""
    dec, feats, caps, lengths, _ = decoder_and_batch((10, 49, 40, 20), 0.5, grouped=grouped,
                                                     attention=attention)
    dec.use_fast_path(mode)  # type: ignore[arg-type]
    half = feats.half()
    read: list[torch.dtype] = []
    apply = native.NativeContext.apply
    monkeypatch.setattr(native.NativeContext, "apply", staticmethod(
        lambda w, v, rows: read.append(v.dtype) or apply(w, v, rows)))
    runs = []
    for grid in (half, half.float()):
        dec.zero_grad()
        torch.manual_seed(3)  # the same dropout masks and sampled locations
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = dec(grid, caps, lengths)
        (out.logits.float().pow(2).mean() + out.alphas.float().pow(2).mean()).backward()
        runs.append([out.logits, out.alphas, *(p.grad for p in dec.parameters())])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    n = len(read) // 2
    if mode == "off":
        assert not read
    else:  # under autocast both grids reach the kernel as the same bf16
        first = torch.bfloat16 if bf16 else torch.float16
        assert n > 0 and read == [first] * n + [torch.bfloat16 if bf16 else torch.float32] * n


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("A", [64, 37], ids=["vector-width", "with-a-tail"])
def test_the_keys_gradient_sums_over_the_steps_of_a_pass(A: int, dtype: torch.dtype) -> None:
    """Three steps of a pass (5, 4 and 2 running captions) add into one keys' gradient: equal to
    the formula's sum in fp32 (1e-5), as near it as the ATen ops' in bf16."""
    g = torch.Generator().manual_seed(4)
    keys, w = torch.randn(5, 49, A, generator=g), torch.randn(1, A, generator=g) * 0.3
    qs = [torch.randn(b, A, generator=g) for b in (5, 4, 2)]
    ups = [torch.randn(q.size(0), 49, generator=g) for q in qs]

    def keys_grad(fn: str, keys: Tensor) -> Tensor:
        k = keys.clone().requires_grad_()
        kin, sink = (k, None) if fn == "formula" else PassGradient.through(k)
        total = 0
        for q, up in zip(qs, ups):
            if fn == "formula":
                e = torch.tanh(kin[: q.size(0)] + q.to(kin.dtype).unsqueeze(1)) @ w[0].to(kin.dtype)
            else:
                qk = q.to(kin.dtype)
                e = (native.NativeAdditiveScore.apply(kin, qk, w, sink, None) if fn == "native"
                     else AdditiveScore.apply(kin, qk, w, sink))
            total = total + (e * up.to(e.dtype)).sum()
        total.backward()
        return k.grad

    ref = keys_grad("formula", keys.double())
    got = keys_grad("native", keys.to(dtype))
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)
    else:
        aten = keys_grad("ops", keys.to(dtype))
        err_ours, err_aten = ((x.double() - ref).abs().max().item() for x in (got, aten))
        assert err_ours <= 1.1 * err_aten + 1e-6, (err_ours, err_aten)


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("summed", [False, True], ids=["own-gradient", "summed-over-the-pass"])
def test_native_score_backs_up_twice_through_a_retained_graph(summed: bool) -> None:
    keys, q, w = (torch.randn(*s, requires_grad=True) for s in ((2, 3, 40), (2, 40), (1, 40)))
    kin, sink = PassGradient.through(keys) if summed else (keys, None)
    e = native.NativeAdditiveScore.apply(kin, q, w, sink, None).sum()
    e.backward(retain_graph=True)
    first = keys.grad.clone(), q.grad.clone(), w.grad.clone()
    e.backward()
    for grad, once in zip((keys.grad, q.grad, w.grad), first):
        torch.testing.assert_close(grad, 2 * once)


@pytest.mark.usefixtures("built")
def test_native_score_in_bf16_is_as_close_to_float32_as_the_aten_ops() -> None:
    """Under bf16 keys, both paths round; the kernel, computing in float32, is no farther from
    the float32 formula than the ATen ops are (with a tenth of a bf16 step to spare)."""
    g = torch.Generator().manual_seed(1)
    keys, q = torch.randn(8, 196, 512, generator=g), torch.randn(6, 512, generator=g)
    w, up = torch.randn(1, 512, generator=g) * 0.1, torch.randn(6, 196, generator=g)
    ref = score_and_grads("formula", keys, q, w, up, summed=False)
    low = [x.bfloat16() for x in (keys, q)]
    for summed in (False, True):
        ours = score_and_grads("native", *low, w, up, summed=summed)
        aten = score_and_grads("ops", *low, w, up, summed=summed)
        assert ours[0].dtype == torch.bfloat16 and ours[1].dtype == torch.bfloat16
        for r, x, y, name in zip(ref, ours, aten, ("scores", "keys grad", "query grad", "w grad")):
            err_ours, err_aten = ((t.float() - r).abs().max().item() for t in (x, y))
            assert err_ours <= 1.1 * err_aten + 1e-6, (name, err_ours, err_aten)


@pytest.mark.parametrize("dims,dropout,batch,attention", [
    ((10, 49, 24, 20), 0.5, "distinct", "soft"), ((10, 49, 24, 20), 0.5, "by-image", "soft"),
    ((10, 49, 24, 20), 0.5, "grid-with-gradient", "soft"),
    ((10, 49, 24, 20), 0.5, "by-image", "hard"), ((32, 196, 512, 512), 0.0, "by-image", "soft")],
    ids=["small-dropout", "small-by-image", "small-fine-tuned", "small-hard-by-image",
         "issue17-size-by-image"])
@pytest.mark.parametrize("faster", [True, False], ids=["onednn-faster", "aten-faster"])
@pytest.mark.usefixtures("built")
def test_decoder_with_the_native_kernel_equals_the_aten_path(
        dims: tuple[int, int, int, int], dropout: float, batch: str, attention: str,
        faster: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`fast_path: native` gives `off`'s loss to 1e-5 and every gradient, on a fixed batch: of
    distinct images, of five captions an image (the native pass keeps one row of annotations
    and keys per image, which its captions read through `rows`), of a grid that takes a
    gradient (per caption, as `off`), and with hard attention's sampled locations; with the
    pass's other products by oneDNN or by ATen, as either is the faster on a machine."""
    for module in (decoder_module, pass_grads):
        monkeypatch.setattr(module, "onednn_is_faster", lambda: faster)
    dec, feats, caps, lengths, g = decoder_and_batch(dims, dropout, attention=attention,
                                                     grouped=batch == "by-image")
    B = feats.size(0)
    weights = torch.randn(B, int(lengths.max()) - 1, 40, generator=g)  # each logit differently
    read: list[tuple[int, int]] = []  # (annotation rows, captions) of each native context
    apply = native.NativeContext.apply
    monkeypatch.setattr(native.NativeContext, "apply", staticmethod(
        lambda w, v, rows: read.append((v.size(0), rows.size(0))) or apply(w, v, rows)))
    onednn: list[bool] = []  # whether each pass's recurrent product ran by oneDNN

    class Recording(decoder_module.RecurrentProduct):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            onednn.append(self.onednn)

    monkeypatch.setattr(decoder_module, "RecurrentProduct", Recording)
    runs = []
    for mode in ("off", "native"):
        dec.use_fast_path(mode)  # type: ignore[arg-type]
        assert dec.fast_path == mode and dec.attention.native == (mode == "native")
        dec.zero_grad()
        x = feats.clone().requires_grad_(batch == "grid-with-gradient")
        torch.manual_seed(3)
        loss = (dec(x, caps, lengths).logits * weights).sum() / B
        loss.backward()
        grads = {n: p.grad.clone() for n, p in dec.named_parameters()}
        if x.grad is not None:
            grads["features"] = x.grad
        runs.append((loss.item(), grads))
    (loss_off, g_off), (loss_native, g_native) = runs
    assert abs(loss_off - loss_native) <= 1e-5 * max(1.0, abs(loss_off))
    assert g_off.keys() == g_native.keys()
    for name, grad in g_off.items():
        torch.testing.assert_close(g_native[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    distinct = len(torch.unique(feats.flatten(1), dim=0))
    assert distinct == (-(-B // 5) if batch == "by-image" else B)
    # oneDNN's recurrent product on the native path only (where this torch has oneDNN)
    assert onednn == [False, torch.backends.mkldnn.is_available()]
    if batch == "grid-with-gradient":
        assert not read  # the kernel gives no gradient of the annotations: the ATen path
    else:  # every step read the distinct images' rows, the first step all B captions
        assert read and {n for n, _ in read} == {distinct} and read[0][1] == B


@pytest.mark.usefixtures("built")
def test_auto_is_native_on_the_cpu_and_other_scorers_stay_off() -> None:
    assert resolve_fast_path("auto", torch.device("cpu"), "hard") == "native"
    assert resolve_fast_path("native", torch.device("cuda")) == "off"  # a CPU kernel
    dec = AttentionLSTMDecoder(vocab_size=12, feature_dim=8, embed_dim=6, hidden_dim=6,
                               attn_dim=5, score="dot")
    dec.use_fast_path("native")
    assert dec.fast_path == "off" and not dec.attention.native  # no kernel for the dot score
    att = AdditiveAttention(feature_dim=8, hidden_dim=6, attn_dim=5)
    assert att.use_native(True)
    e = att(att.project(torch.randn(2, 9, 8)), torch.randn(2, 6))
    assert "NativeAdditiveScore" in type(e.grad_fn).__name__
    e64 = att.double()(att.project(torch.randn(2, 9, 8).double()), torch.randn(2, 6).double())
    assert "NativeAdditiveScore" not in type(e64.grad_fn).__name__  # float64: the ATen ops


def run_python(code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO,
                          capture_output=True, text=True, timeout=timeout)


def test_a_machine_that_cannot_build_it_trains_with_the_aten_ops() -> None:
    """No compiler (cpp_extension fails): one warning, `native` falls back to `off`."""
    result = run_python("""
        import logging, torch
        from torch.utils import cpp_extension
        def no_compiler(*args, **kwargs):
            raise RuntimeError("Error building extension 'x': c++: not found")
        cpp_extension.load = no_compiler
        logging.basicConfig(level=logging.WARNING)
        from captioning.models.decoder import AttentionLSTMDecoder
        dec = AttentionLSTMDecoder(vocab_size=12, feature_dim=8, embed_dim=6, hidden_dim=6,
                                   attn_dim=5)
        dec.use_fast_path("native")
        dec.use_fast_path("native")
        out = dec(torch.randn(2, 9, 8), torch.randint(4, 12, (2, 5)), torch.tensor([5, 4]))
        out.logits.sum().backward()
        print("fast_path", dec.fast_path, type(out.logits.grad_fn).__name__)
    """)
    assert result.returncode == 0, result.stderr
    assert "fast_path off" in result.stdout
    warnings = [line for line in result.stderr.splitlines() if "could not be built" in line]
    assert len(warnings) == 1 and "c++: not found" in warnings[0], result.stderr


@pytest.mark.usefixtures("built")
def test_a_build_killed_halfway_does_not_block_the_next(tmp_path: Path) -> None:
    """A killed build leaves cpp_extension's `lock` file behind, and older torch releases waited
    while it existed: for ever. Here cpp_extension's lock is swapped for such a wait (given up
    after 20 s): the build removes the stale file under its own lock, and runs."""
    name, _ = native.build_flags()
    (tmp_path / name).mkdir()
    (tmp_path / name / "lock").write_text("")  # as a killed build leaves it
    result = run_python(f"""
        import os, time, torch
        from pathlib import Path
        from torch.utils import cpp_extension

        class WaitWhileItExists:  # the lock file of older torch releases
            def __init__(self, path):
                self.path = path
            def __enter__(self):
                start = time.monotonic()
                while os.path.exists(self.path):
                    if time.monotonic() - start > 20:
                        raise TimeoutError("waited 20 s on " + self.path)
                    time.sleep(0.1)
                open(self.path, "x").close()
            def __exit__(self, *exc):
                os.remove(self.path)

        cpp_extension.FileLock = WaitWhileItExists
        from captioning.models import native
        native.build(Path({str(tmp_path)!r}))
        keys, q, w = torch.randn(2, 3, 40), torch.randn(2, 40), torch.randn(40)
        print("scores", tuple(torch.ops.captioning_native.additive_score(keys, q, w, None).shape))
    """, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "scores (2, 3)" in result.stdout
    assert list((tmp_path / name).glob("*.so"))


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("grouped", [False, True], ids=["distinct", "by-image"])
def test_training_loss_is_unchanged_by_the_kernel_under_autocast(grouped: bool) -> None:
    """bf16 autocast, a decoder step (captions of spread lengths, by image or not): the
    kernel's loss is as near float32's as the ops'."""
    dec, feats, caps, lengths, _ = decoder_and_batch((15, 49, 64, 32), 0.0, grouped=grouped)
    losses = {}
    for mode, bf16 in (("off", False), ("off", True), ("native", True)):
        dec.use_fast_path(mode)  # type: ignore[arg-type]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            logits = dec(feats, caps, lengths).logits
        mask = torch.arange(logits.size(1)) < (lengths - 1).unsqueeze(1)
        targets = caps[:, 1:logits.size(1) + 1]
        losses[mode, bf16] = F.cross_entropy(logits[mask].float(), targets[mask]).item()
    exact = losses["off", False]
    assert abs(losses["native", True] - exact) <= 2 * abs(losses["off", True] - exact) + 1e-3


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("capability", ["AVX2", "DEFAULT"])
def test_the_kernel_builds_and_scores_right_at_every_vector_width(capability: str,
                                                                  tmp_path: Path) -> None:
    """What a machine without AVX-512 (or without AVX2) builds, run here: equal to the formula.
    Skipped where this CPU lacks the width."""
    if capability == "AVX2" and torch.backends.cpu.get_cpu_capability() not in ("AVX2",
                                                                                "AVX512"):
        pytest.skip("this CPU has no AVX2")
    result = run_python(f"""
        import torch
        from pathlib import Path
        torch.backends.cpu.get_cpu_capability = lambda: {capability!r}
        from captioning.models import native
        assert native.build_flags()[0].startswith("captioning_native_{capability.lower()}_")
        native.build(Path({str(tmp_path)!r}))
        g = torch.Generator().manual_seed(0)
        keys, q = torch.randn(4, 7, 37, generator=g), torch.randn(3, 37, generator=g)
        w, up = torch.randn(37, generator=g), torch.randn(3, 7, generator=g)
        ops = torch.ops.captioning_native
        k64, q64, w64 = (x.double().requires_grad_() for x in (keys, q, w))
        e = torch.tanh(k64[:3] + q64.unsqueeze(1)) @ w64
        e.backward(up.double())
        dkeys = torch.zeros_like(keys)
        dq, dw = ops.additive_score_backward(up, keys, q, w, None, dkeys)
        for got, ref in ((ops.additive_score(keys, q, w, None), e), (dkeys, k64.grad),
                         (dq, q64.grad), (dw, w64.grad)):
            torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        rows = torch.tensor([1, 3, 1])  # two captions share a row
        k64 = keys.double().requires_grad_()
        e = torch.tanh(k64[rows] + q.double().unsqueeze(1)) @ w.double()
        e.backward(up.double())
        dkeys = torch.zeros_like(keys)
        ops.additive_score_backward(up, keys, q, w, rows, dkeys)
        for got, ref in ((ops.additive_score(keys, q, w, rows), e), (dkeys, k64.grad)):
            torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        a = torch.softmax(up, -1)  # the context over the keys as annotations, by those rows
        z = ops.attention_context(a, keys, rows)
        ref = torch.bmm(a.double().unsqueeze(1), keys.double()[rows]).squeeze(1)
        torch.testing.assert_close(z.double(), ref, rtol=1e-5, atol=1e-5)
        x = torch.randn(41, 37, generator=g)  # the transposing kernel: tiles and tails
        assert torch.equal(ops.transposed(x), x.t().contiguous())
        dz = torch.randn(3, 37, generator=g)
        ref = torch.bmm(keys.double()[rows], dz.double().unsqueeze(2))[..., 0]
        torch.testing.assert_close(ops.attention_context_backward(dz, keys, rows).double(), ref,
                                   rtol=1e-5, atol=1e-5)
        low = keys.bfloat16()  # bf16 keys: the same sums, rounded to bf16 where stored
        k64 = low.double().requires_grad_()
        e = torch.tanh(k64[:3] + q.double().unsqueeze(1)) @ w.double()
        e.backward(up.double())
        dkeys = torch.zeros_like(low)
        ops.additive_score_backward(up, low, q, w, None, dkeys)
        torch.testing.assert_close(ops.additive_score(low, q, w, None).double(), e.detach(),
                                   rtol=1e-2, atol=2e-2)
        torch.testing.assert_close(dkeys.double(), k64.grad, rtol=1e-2, atol=1e-2)
        gates, c = torch.randn(9, 4 * 37, generator=g), torch.randn(9, 37, generator=g)
        g64, c64 = gates.double().requires_grad_(), c.double().requires_grad_()
        i, f, gg, o = g64.chunk(4, dim=1)  # the LSTM cell, a vector body and a tail
        c_ref = f.sigmoid() * c64 + i.sigmoid() * gg.tanh()
        h_ref = o.sigmoid() * c_ref.tanh()
        (h_ref * 2 + c_ref).sum().backward()
        h, c_new, acts = ops.lstm_cell(gates, c)
        dgates, dc = ops.lstm_cell_backward(torch.full_like(h, 2.0), torch.ones_like(h), acts, c)
        for got, ref in ((h, h_ref), (c_new, c_ref), (dgates, g64.grad), (dc, c64.grad)):
            torch.testing.assert_close(got.double(), ref.detach(), rtol=1e-5, atol=1e-5)
        print("equal")
    """, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "equal" in result.stdout


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("shape", [(37, 21), (6272 // 98, 512), (16, 16), (1, 5), (0, 3)],
                         ids=["tails", "keys-like", "one-tile", "one-row", "empty"])
def test_the_transposing_kernel_equals_atens_transpose(shape: tuple[int, int]) -> None:
    """`native.transposed`: t^T, contiguous, to the bit, whole tiles and their tails alike;
    None for what it does not take (another dtype, a view that is not contiguous)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(1))
    out = native.transposed(t)
    assert out is not None and out.is_contiguous() and torch.equal(out, t.t())
    assert native.transposed(t.double()) is None
    assert native.transposed(torch.randn(4, 10)[:, ::2]) is None


def test_memory_rows_are_taken_and_repeated_as_the_captions_are() -> None:
    """A memory whose captions read shared rows, cut to its first captions or reordered and
    repeated (as decoding does), reads what the same memory expanded per caption reads."""
    values, keys = torch.randn(3, 4, 5), torch.randn(3, 4, 6)
    rows = torch.tensor([2, 0, 2, 1])
    shared, expanded = Memory(values, keys, rows), Memory(values[rows], keys[rows])
    for a, b in ((shared.first(3), expanded.first(3)),
                 (shared.select(torch.tensor([3, 3, 0])), expanded.select(torch.tensor([3, 3, 0])))):
        assert a.rows is not None and b.rows is None
        torch.testing.assert_close(a.values[a.rows], b.values[: len(a.rows)])
        torch.testing.assert_close(a.keys[a.rows], b.keys[: len(a.rows)])


@pytest.mark.usefixtures("built")
@pytest.mark.parametrize("H", [64, 37], ids=["vector-width", "with-a-tail"])
@pytest.mark.parametrize("upstream", ["h-and-c", "h-only", "c-only"])
def test_the_lstm_cell_kernel_equals_the_formula_and_its_gradients(H: int, upstream: str
                                                                    ) -> None:
    """`NativeLSTMCell` against nn.LSTMCell's update in float64: h and c to float32 rounding,
    the gradients of the gates and of c_{t-1} to 1e-5, with either output's gradient absent
    (a step whose c or h reaches nothing)."""
    g = torch.Generator().manual_seed(6)
    b = 37  # rows over several threads' tasks
    gates0 = torch.randn(b, 4 * H, generator=g) * 3  # saturating gates too
    c0 = torch.randn(b, H, generator=g) * 2
    dh, dc = torch.randn(b, H, generator=g), torch.randn(b, H, generator=g)

    def run(fn: Any, dtype: torch.dtype) -> tuple[Tensor, ...]:
        gates, c = (x.to(dtype, copy=True).requires_grad_() for x in (gates0, c0))
        h, c_new = fn(gates, c)
        loss = ((h * dh.to(dtype)).sum() if upstream != "c-only" else 0) + (
            (c_new * dc.to(dtype)).sum() if upstream != "h-only" else 0)
        loss.backward()
        return h.detach(), c_new.detach(), gates.grad, c.grad

    got = run(native.NativeLSTMCell.apply, torch.float32)
    ref = run(lambda gates, c: native.lstm_cell(gates, c, kernel=False), torch.float64)
    for a, b, tol in zip(got, ref, (2e-6, 2e-6, 1e-5, 1e-5)):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a.double(), b, rtol=tol, atol=tol)


@pytest.mark.usefixtures("built")
def test_the_native_decoder_steps_its_cell_by_the_kernel(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """Each word step of the native path runs the cell kernel (and `off` never does); the
    decoder's equality with `off` is tested above."""
    calls: list[int] = []
    apply = native.NativeLSTMCell.apply
    monkeypatch.setattr(native.NativeLSTMCell, "apply",
                        lambda *a: (calls.append(a[0].size(0)), apply(*a))[1])
    dec, feats, caps, lengths, _ = decoder_and_batch((6, 5, 8, 8), 0.0)
    for mode in ("off", "native"):
        dec.use_fast_path(mode)  # type: ignore[arg-type]
        dec(feats, caps, lengths).logits.sum().backward()
    steps = (lengths - 1).clamp_min(0)
    assert calls == [int((steps > t).sum()) for t in range(int(steps.max()))]


@pytest.mark.usefixtures("built")
def test_decoding_on_the_native_path_equals_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy and beam search, and sampling with gradients (SCST's policy), step through the
    native kernels, the cell's included: `off`'s captions, their scores to 1e-5 and the sampled
    captions' gradients to 1e-4 relative."""
    calls: list[int] = []
    apply = native.NativeLSTMCell.apply
    monkeypatch.setattr(native.NativeLSTMCell, "apply",
                        lambda *a: (calls.append(1), apply(*a))[1])
    dec, feats, _, _, _ = decoder_and_batch((4, 9, 16, 16), 0.0)
    dec.eval()
    runs = {}
    for mode in ("off", "native"):
        dec.use_fast_path(mode)  # type: ignore[arg-type]
        dec.zero_grad()
        with torch.no_grad():
            found = [greedy_search(dec, feats, max_len=7),
                     beam_search(dec, feats, beam_size=3, max_len=7)]
        sampled = sample_search(dec, feats, num_samples=2, max_len=6, grad=True,
                                generator=torch.Generator().manual_seed(0))
        assert sampled.token_log_probs is not None
        sampled.token_log_probs.sum().backward()
        runs[mode] = ([*found, sampled], [torch.zeros_like(p) if p.grad is None else p.grad.clone()
                                          for p in dec.parameters()])
        assert bool(calls) == (mode == "native")
    (off, off_grads), (fast, fast_grads) = runs["off"], runs["native"]
    for a, b in zip(off, fast):
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(a.scores, b.scores, rtol=1e-5, atol=1e-5)
    for a, b in zip(off_grads, fast_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_build_goes_under_torch_extensions_dir(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """As the README says (and torch's own builds do): `make` sets it to .cache/ in the
    checkout; without it, torch's per-user folder."""
    from torch.utils import cpp_extension

    from captioning.models.native import extensions_root

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_root() == tmp_path
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extensions_root() == Path(cpp_extension.get_default_build_root())
