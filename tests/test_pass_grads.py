"""Gradients a teacher-forced pass sums in one place (`captioning.models.pass_grads`): every
gradient equals plain autograd's over the same steps."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from captioning.models import native, pass_grads
from captioning.models.pass_grads import (
    PassGradient,
    RecurrentProduct,
    linear,
    lstm_pass_weights,
    mm,
    onednn_usable,
)

ROWS = (5, 5, 4, 2, 1)  # a shrinking batch, as the decoder's: captions end one by one


def _unrolled(weight: Tensor, keys: Tensor, bias: Tensor, x0: Tensor, *, defer: bool,
              onednn: bool = False) -> Tensor:
    """A toy pass: x_{t+1} = tanh(b_t + x_t W + (first rows of the keys) · x_t) on the rows
    still running; the loss also reads W directly, outside the steps."""
    product = RecurrentProduct(weight, defer=defer, onednn=onednn)
    assert product.onednn == (onednn and defer and torch.backends.mkldnn.is_available())
    # oneDNN's steps read W packed both ways; the transposed one where the kernel transposes it
    assert product.packed == (None, None) or (product.onednn and product.packed[0] is not None)
    keys, _ = PassGradient.through(keys, defer=defer)  # its sum from plain slicing's grads
    x, total = x0, x0.new_zeros(())
    for t, rows in enumerate(ROWS):
        k = keys[:rows]
        mixed = (k * x[:rows].unsqueeze(1)).sum(1)  # (rows, 6)
        x = torch.tanh(product(bias[t, :rows], x[:rows]) + mixed)
        total = total + (x * torch.arange(1.0, x.size(1) + 1)).sum()
    return total + weight.square().sum()


def _grads(defer: bool, retain: bool = False, onednn: bool = False) -> list[Tensor]:
    g = torch.Generator().manual_seed(0)
    weight = (torch.randn(6, 6, generator=g) / 3).requires_grad_()
    keys = (torch.randn(5, 3, 6, generator=g) / 3).requires_grad_()
    bias = torch.randn(len(ROWS), 5, 6, generator=g).requires_grad_()
    x0 = torch.randn(5, 6, generator=g).requires_grad_()
    params = (weight, keys, bias, x0)
    loss = _unrolled(weight.t(), keys, bias, x0, defer=defer, onednn=onednn)  # W: a .t() view
    loss.backward(retain_graph=retain)
    grads = [p.grad.clone() for p in params]
    if retain:  # a second backward through the retained graph sums afresh
        for p in params:
            p.grad = None
        loss.backward()
        grads += [p.grad.clone() for p in params]
    return grads


@pytest.mark.parametrize("onednn", [False, True], ids=["aten", "onednn-products"])
@pytest.mark.parametrize("retain", [False, True], ids=["once", "retained-graph-twice"])
def test_gradients_equal_plain_autograd(retain: bool, onednn: bool) -> None:
    """Summed over the pass (the steps' products by ATen or by oneDNN) as plain autograd."""
    summed, plain = _grads(True, retain, onednn), _grads(False, retain)
    assert len(summed) == (8 if retain else 4)
    for a, b in zip(summed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert summed[0].abs().sum() > 0 and summed[1][:, :, :].abs().sum() > 0


def test_the_sums_are_formed_in_one_place_and_freed_with_the_graph() -> None:
    import gc
    import weakref

    weight = torch.randn(4, 3, requires_grad=True)
    product = RecurrentProduct(weight)
    out = product(torch.zeros(2, 3), torch.randn(2, 4)) + product(torch.zeros(1, 3),
                                                                   torch.randn(1, 4))
    assert product.grad is not None and product.weight.grad_fn is not None
    out.sum().backward()
    assert product.grad.take() is None  # handed over to autograd and cleared
    sink = weakref.ref(product.grad)
    gc.disable()  # freed by reference counting alone, as each training step's graph must be
    try:
        del product, out
        assert sink() is None
    finally:
        gc.enable()


def test_the_keys_gradient_sums_only_running_rows() -> None:
    keys = torch.randn(4, 3, 2, requires_grad=True)
    seen, sink = PassGradient.through(keys)
    assert sink is not None
    sink.add_rows(torch.ones(2, 3, 2))
    sink.add_rows(torch.ones(4, 3, 2))
    total = sink.take()
    assert total is not None and total[:2].eq(2).all() and total[2:].eq(1).all()
    assert sink.take() is None and seen.grad_fn is not None


def test_without_autograd_it_is_plain_addmm() -> None:
    w, b, x = torch.randn(4, 3, requires_grad=True), torch.randn(2, 3), torch.randn(2, 4)
    with torch.no_grad():
        product = RecurrentProduct(w)
        assert product.grad is None and product.weight is w
        torch.testing.assert_close(product(b, x), torch.addmm(b, x, w))


@pytest.mark.parametrize("bias", [False, True], ids=["no-bias", "vector-bias"])
@pytest.mark.parametrize("onednn", [False, True], ids=["aten", "onednn-products"])
def test_a_layers_product_over_a_pass_is_the_layers_and_sums_its_gradient(onednn: bool,
                                                                         bias: bool) -> None:
    """The scorer's query h_{t-1} W_q^T over a pass (`Scorer.query_product`), without a bias or
    with the layer's (N,): outputs equal the layer's, gradients equal plain autograd's."""
    g = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(6, 4, bias=bias)
    xs = [torch.randn(rows, 6, generator=g, requires_grad=True) for rows in ROWS]
    coef = torch.randn(4, generator=g)
    product = RecurrentProduct(layer.weight.t(), onednn=onednn)
    assert product.grad is not None
    assert product.onednn == (onednn and torch.backends.mkldnn.is_available())
    # packed for both ways: W_q^T lies contiguous; W_q where the native kernel transposes it
    assert (product.packed[0] is not None) == product.onednn
    assert (product.packed[1] is not None) == (product.onednn and native.loaded())
    outs = [product(layer.bias, x) for x in xs]
    for out, x in zip(outs, xs):
        torch.testing.assert_close(out, layer(x), rtol=1e-6, atol=1e-6)
    sum((out * coef).sum() for out in outs).backward()
    params = list(layer.parameters())
    summed = [*(p.grad.clone() for p in params), *(x.grad.clone() for x in xs)]
    for t in (*params, *xs):
        t.grad = None
    sum((layer(x) * coef).sum() for x in xs).backward()
    plain = [*(p.grad for p in params), *(x.grad for x in xs)]
    assert len(summed) == len(plain) == len(params) + len(xs)
    for a, b in zip(summed, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert summed[0].abs().sum() > 0
    with torch.no_grad():  # no pass to sum over: x W itself
        torch.testing.assert_close(RecurrentProduct(layer.weight.t())(layer.bias, xs[0]),
                                   layer(xs[0]), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no-bias"])
def test_under_autocast_the_steps_read_one_cast_and_the_gradient_keeps_its_dtype(
        with_bias: bool) -> None:
    """Under bf16 autocast (as Lightning's, without its weight-cast cache) the steps read the
    weight cast once a pass; its gradient comes back float32, as autocast's own gives it. With a
    bias (the LSTM's) and without (the scorer's query)."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(6, 8, generator=g).requires_grad_()
    plain = weight.detach().clone().requires_grad_()
    xs = [torch.randn(rows, 6, generator=g) for rows in ROWS]
    bias = torch.randn(5, 8, generator=g) if with_bias else torch.zeros(5, 8)
    outs = []
    for w, summed in ((weight, True), (plain, False)):
        with torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False):
            product = RecurrentProduct(w) if summed else None
            if product is not None:
                assert product.weight.dtype == torch.bfloat16  # one cast, read by every step
            # the weight the steps read, also read directly: its gradient adds to the pass's
            read = product.weight if product is not None else w.to(torch.bfloat16)
            total = read.float().square().sum()
            for x in xs:
                b = bias[: len(x)] if with_bias else None
                y = product(b, x) if product else torch.addmm(bias[: len(x)], x, w)
                assert y.dtype == torch.bfloat16
                total = total + torch.tanh(y.float()).sum()
        total.backward()
        outs.append(total.detach())
    assert weight.grad is not None and weight.grad.dtype == torch.float32
    torch.testing.assert_close(outs[0], outs[1])
    torch.testing.assert_close(weight.grad, plain.grad, rtol=2e-2, atol=2e-2)


def test_the_lstm_weights_of_a_pass_get_plain_gradients_in_their_own_layout() -> None:
    """The word part and [W_z | W_hh]^T of nn.LSTMCell's weights, used as a pass uses them (the
    word gates' product, then steps by `RecurrentProduct`): each parameter's gradient equals
    slicing's and concatenating's, and comes back contiguous, in the parameter's layout."""
    E, D, H = 3, 4, 5
    g = torch.Generator().manual_seed(1)
    cell = torch.nn.LSTMCell(E + D, H)
    emb = torch.randn(6, E, generator=g)
    xs = [torch.randn(b, D + H, generator=g) for b in (6, 6, 3)]
    grads = []
    for ours in (True, False):
        cell.zero_grad(set_to_none=True)
        if ours:
            word, recurrent = lstm_pass_weights(cell.weight_ih, cell.weight_hh, E)
        else:
            word = cell.weight_ih[:, :E]
            recurrent = torch.cat([cell.weight_ih[:, E:], cell.weight_hh], dim=1).t()
        gates = emb @ word.t()  # (6, 4H)
        product = RecurrentProduct(recurrent, defer=ours)
        loss = sum((torch.tanh(product(gates[: x.size(0)], x)) * (i + 1)).sum()
                   for i, x in enumerate(xs))
        loss.backward()
        grads.append((cell.weight_ih.grad, cell.weight_hh.grad))
    for got, ref in zip(grads[0], grads[1]):
        assert got.is_contiguous() and got.abs().sum() > 0
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def spy_onednn(weight: Tensor, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The calls of oneDNN's product from now on, one entry each (the test skips where oneDNN
    cannot take `weight`'s float32 products)."""
    if not onednn_usable(weight):
        pytest.skip("oneDNN cannot take float32 products here")
    calls: list[int] = []
    op = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: (calls.append(1), op(*a))[1])
    return calls


@pytest.mark.parametrize("shape", [(7, 12), (3, 5, 12)], ids=["rows", "a-grid"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "frozen-x"])
@pytest.mark.parametrize("faster", [True, False], ids=["onednn-faster", "aten-faster"])
def test_linear_by_onednn_equals_f_linear_and_its_gradients(
        shape: tuple[int, ...], bias: bool, x_grad: bool, faster: bool,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear(onednn=True)`: the forward by oneDNN where it takes a float32 product (spied),
    and the gradients' products too where it is the faster (`onednn_is_faster`), equal to
    F.linear's to float32 rounding; a frozen input gets no gradient, and no product for one."""
    monkeypatch.setattr(pass_grads, "onednn_is_faster", lambda: faster)
    g = torch.Generator().manual_seed(3)
    x0 = torch.randn(*shape, generator=g)
    w0, b0 = torch.randn(9, 12, generator=g), torch.randn(9, generator=g)
    up = torch.randn(*shape[:-1], 9, generator=g)
    calls = spy_onednn(w0, monkeypatch)

    def run(onednn: bool) -> list[Tensor | None]:
        x, w = x0.clone().requires_grad_(x_grad), w0.clone().requires_grad_()
        b = b0.clone().requires_grad_() if bias else None
        y = linear(x, w, b, onednn=onednn)
        (y * up).sum().backward()
        return [y.detach(), x.grad, w.grad, None if b is None else b.grad]

    fast, ref = run(True), run(False)
    # the output; W's gradient, and x's where it needs one, where oneDNN is the faster
    assert len(calls) == 1 + faster * (1 + x_grad)
    for a, b in zip(fast, ref, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)
    assert (fast[1] is None) == (not x_grad)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast's products: F.linear's
        assert linear(x0, w0, b0, onednn=True).dtype == torch.bfloat16


def test_a_product_of_many_rows_reads_its_weight_packed_and_equals_f_linear(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`linear` by oneDNN packs its weight first from `PACK_ROWS` rows on (the keys of a
    batch's grids), not below; equal to F.linear either way, gradients too."""
    if not onednn_usable(torch.ones(1)):
        pytest.skip("oneDNN cannot take float32 products here")
    packed: list[int] = []
    real = pass_grads.pack
    monkeypatch.setattr(pass_grads, "pack", lambda w, *, rows=32: (packed.append(rows),
                                                                   real(w, rows=rows))[1])
    g = torch.Generator().manual_seed(8)
    w, b = torch.randn(9, 12, generator=g, requires_grad=True), torch.randn(9, generator=g)
    for rows, expect in ((pass_grads.PACK_ROWS + 5, [pass_grads.PACK_ROWS + 5]), (40, [])):
        packed.clear()
        x = torch.randn(rows, 12, generator=g)
        out = linear(x.view(-1, rows // 5 if rows % 5 == 0 else rows, 12), w, b, onednn=True)
        assert packed == expect
        ref = F.linear(x, w, b)
        torch.testing.assert_close(out.reshape(rows, 9), ref, rtol=1e-5, atol=1e-5)
        up = torch.randn(rows, 9, generator=g)
        (dw,) = torch.autograd.grad((out.reshape(rows, 9) * up).sum(), w)
        (ref_dw,) = torch.autograd.grad((ref * up).sum(), w)
        torch.testing.assert_close(dw, ref_dw, rtol=1e-4, atol=1e-4)


def test_a_product_by_onednn_equals_atens_for_any_operand_layout(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """`mm`: a @ b by oneDNN for float32 operands as they lie (either one transposed, or a
    strided slice, copied first), to float32 rounding; other dtypes, and `onednn` False, by
    ATen."""
    g = torch.Generator().manual_seed(5)
    a, b = torch.randn(40, 24, generator=g), torch.randn(24, 16, generator=g)
    calls = spy_onednn(b, monkeypatch)
    layouts = [(a, b), (a.t().contiguous().t(), b), (a, b.t().contiguous().t()),
               (torch.randn(40, 48, generator=g)[:, ::2], b)]  # the last: neither way contiguous
    for x, y in layouts:
        torch.testing.assert_close(mm(x, y), x @ y, rtol=1e-6, atol=1e-5)
    assert len(calls) == len(layouts)
    assert torch.equal(mm(a.double(), b.double()), a.double() @ b.double())
    assert torch.equal(mm(a, b, onednn=False), a @ b)
    assert len(calls) == len(layouts)  # neither went to oneDNN


@pytest.mark.parametrize("kernel", [True, False], ids=["native-kernel", "no-kernel"])
def test_a_transposed_operand_is_made_contiguous_by_the_native_kernel_where_it_is_loaded(
        kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """`contiguous`: a transposed view (a weight gradient's G^T) copied by `native.transposed`
    where the kernels are loaded, and by ATen's copy where they are not, or where the view is
    not a plain transpose; the values alike, the product by it equal."""
    if kernel and not native.available():
        pytest.skip("the native kernels cannot be built here")
    monkeypatch.setattr(native, "loaded", lambda: kernel)
    calls: list[bool] = []  # whether the kernel copied, a call each
    real = native.transposed

    def spy(t: Tensor) -> Tensor | None:
        out = real(t)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(native, "transposed", spy)
    g = torch.Generator().manual_seed(6)
    grad, x = torch.randn(37, 21, generator=g), torch.randn(37, 5, generator=g)
    a = pass_grads.contiguous(grad.t())
    assert a.is_contiguous() and torch.equal(a, grad.t())
    torch.testing.assert_close(mm(grad.t(), x), grad.t() @ x, rtol=1e-6, atol=1e-5)
    assert calls == [kernel, kernel]  # it copies where it is loaded
    strided = torch.randn(21, 74, generator=g)[:, ::2]  # neither way contiguous: ATen's copy
    out = pass_grads.contiguous(strided)
    assert out.is_contiguous() and torch.equal(out, strided) and calls[2:] == [False]
    assert pass_grads.contiguous(x) is x and len(calls) == 3


def test_the_faster_of_onednn_and_aten_is_timed_once_off_the_global_random_stream() -> None:
    """`onednn_is_faster`: a verdict for the process, timed once, whose inputs come from a
    generator of its own (the training's random stream goes on as it would have)."""
    pass_grads.onednn_is_faster.cache_clear()
    before = torch.random.get_rng_state()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a first call under autocast: the
        verdict = pass_grads.onednn_is_faster()  # float32 products are timed all the same
    assert torch.equal(torch.random.get_rng_state(), before)
    assert isinstance(verdict, bool)
    assert pass_grads.onednn_is_faster() is verdict
    assert pass_grads.onednn_is_faster.cache_info().misses == 1
    if onednn_usable(torch.ones(1)):  # its product was timed: oneDNN's, where it can take it
        calls: list[int] = []
        monkey = pytest.MonkeyPatch()
        op = torch.ops.mkldnn._linear_pointwise
        monkey.setattr(torch.ops.mkldnn, "_linear_pointwise",
                       lambda *a: (calls.append(1), op(*a))[1])
        try:
            pass_grads.onednn_is_faster.cache_clear()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                pass_grads.onednn_is_faster()
        finally:
            monkey.undo()
            pass_grads.onednn_is_faster.cache_clear()
        assert calls


def test_a_layer_by_onednn_equals_the_layer_whose_hooks_run_only_on_atens_path() -> None:
    layer = torch.nn.Linear(12, 9)
    seen: list[int] = []
    layer.register_forward_hook(lambda m, inp, out: seen.append(out.size(0)))
    x = torch.randn(7, 12, generator=torch.Generator().manual_seed(2))
    plain = pass_grads.linear_layer(layer, x)
    assert seen == [7]  # the layer was called
    fast = pass_grads.linear_layer(layer, x, onednn=True)
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)
    assert seen == [7] or not onednn_usable(layer.weight)  # oneDNN reads the weights itself
    with torch.autocast("cpu", dtype=torch.bfloat16):  # not oneDNN's: the layer, its hooks
        assert pass_grads.linear_layer(layer, x, onednn=True).dtype == torch.bfloat16
    assert seen[-1] == 7 and len(seen) == (2 if onednn_usable(layer.weight) else 3)
