"""Gradients that a teacher-forced pass sums over its steps, summed in one place.

Some tensors are read by every word step of a pass: the recurrent weight W (D + H, 4H) of the
LSTM's product [ẑ_t, h_{t-1}] W, the scorer's query weight (h_{t-1} W_q^T) and its keys
(B, L, K). Autograd would form each step's gradient of them in full and add it into a running
sum: for a weight a product whose inner size is only the step's batch (32 rows, slow on a CPU),
for the keys a zero-filled (B, L, K) tensor even when only a few captions are still running.
Here a `PassGradient` stands between the tensor and the steps. Their backwards hand it their
parts (a weight: the step's input rows and output gradient; keys: the running rows' gradient,
added in place), and it gives autograd the one sum when the backward reaches the tensor: for a
weight one product over all steps' rows, X^T G.

Made for `loss.backward()`: a backward that stops short of the tensor (`torch.autograd.grad`
with other `inputs`, through a retained graph) would leave its parts for the next one. The
pass is differentiable once (no double backward), as the CPU score kernel always was.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

import captioning.models.native as native

log = logging.getLogger(__name__)


def autocast_dtype(t: Tensor) -> torch.dtype | None:
    """The dtype autocast gives t's device's products now, or None where it is off."""
    device = t.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


class _Collect(torch.autograd.Function):
    """The identity on a tensor; its backward hands over the `PassGradient`'s sum. It runs
    after every step's backward, since every step reads its output."""

    @staticmethod
    def forward(ctx: Any, t: Tensor, sink: PassGradient,  # type: ignore[override]
                dtype: torch.dtype | None) -> Tensor:
        ctx.sink = sink  # the sink holds no tensor of the graph: no reference cycle
        ctx.set_materialize_grads(False)
        return t.view_as(t) if dtype is None else t.to(dtype)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor | None, None, None]:
        total = ctx.sink.take()
        if total is None or grad is None:
            return (grad if total is None else total), None, None
        return total + grad.to(total.dtype), None, None


class PassGradient:
    """Where the steps of one pass sum their parts of one tensor's gradient (module
    docstring). `through` puts one between a tensor and the steps."""

    def __init__(self, like: Tensor, *, onednn: bool = False) -> None:
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.onednn = onednn  # a weight's X^T G by oneDNN where it takes it (`mm`)
        self._inputs: list[Tensor] = []
        self._grads: list[Tensor] = []
        self._dense: Tensor | None = None

    @classmethod
    def through(cls, t: Tensor, *, defer: bool = True, dtype: torch.dtype | None = None,
                onednn: bool = False) -> tuple[Tensor, PassGradient | None]:
        """(the tensor the steps read, its `PassGradient`); (t, None) without autograd, or
        with `defer` False (a compiled pass). `dtype`: the steps read t cast to it once (an
        autocast pass would cast a non-leaf again at every step); the sum stays in t's.
        `onednn`: a weight's sum by oneDNN where it takes it (`mm`)."""
        if not (defer and t.requires_grad and torch.is_grad_enabled()):
            return t, None
        sink = cls(t, onednn=onednn)
        return _Collect.apply(t, sink, None if dtype == t.dtype else dtype), sink

    def add_product(self, x: Tensor, g: Tensor) -> None:
        """A step's part x^T g of a weight's gradient, x (b, K) and g (b, N)."""
        self._inputs.append(x)
        self._grads.append(g)

    def running_sum(self, dtype: torch.dtype) -> Tensor:
        """The sum of the steps' row gradients itself, of the tensor's shape, for a kernel that
        adds a step's rows into it in place. Zero-filled once a pass (in `dtype`), not once a
        step."""
        if self._dense is None:
            self._dense = torch.zeros(self.shape, dtype=dtype, device=self.device)
        return self._dense

    def add_rows(self, d: Tensor, *, scale: Tensor | None = None) -> None:
        """A step's gradient `d` (times `scale`, broadcast, if given) of the first d.size(0)
        rows; the other rows get none."""
        rows = self.running_sum(d.dtype)[: d.size(0)]
        if scale is None:
            rows.add_(d)
        else:
            rows.addcmul_(d, scale)

    def take(self) -> Tensor | None:
        """The sum so far (None if no step added to it), in the tensor's dtype; the next
        backward starts afresh. Under bf16 autocast the product runs in bf16 (summing in
        float32 inside, as autocast's own products do), rounded once; in float32 under fp16,
        whose range one sum over every step's rows could exceed."""
        total, self._dense = self._dense, None
        if self._inputs:
            x, g = torch.cat(self._inputs), torch.cat(self._grads)
            if x.dtype != g.dtype or x.dtype == torch.float16:
                x, g = x.float(), g.float()
            # formed as (g^T x)^T: in the layout of the parameters it is cut from, (out, in), so
            # that cutting it copies whole rows (`lstm_pass_weights`)
            product = mm(g.t(), x, onednn=self.onednn).t()
            total = product if total is None else total + product
            self._inputs, self._grads = [], []
        return None if total is None else total.to(self.dtype)


def onednn_usable(weight: Tensor) -> bool:
    """Whether oneDNN can take a float32 CPU product by `weight` here (autocast off)."""
    return (weight.device.type == "cpu" and weight.dtype == torch.float32
            and autocast_dtype(weight) is None and torch.backends.mkldnn.is_available()
            and torch.backends.mkldnn.enabled and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def mm(a: Tensor, b: Tensor, *, onednn: bool = True) -> Tensor:
    """a @ b, for 2-D a and b; by oneDNN where `onednn` and it takes this float32 product
    (`onednn_usable`), b as it lies, a made `contiguous` first. Equal to ATen's to float32
    rounding."""
    if not (onednn and b.dtype == torch.float32 and _takes(a, b)):
        return a @ b
    return torch.ops.mkldnn._linear_pointwise(contiguous(a), b.t(), None, "none", [], "")


def contiguous(a: Tensor) -> Tensor:
    """a, contiguous: a transposed view (a weight gradient's G^T) by the native kernel where
    it is loaded (`native.transposed`), else by ATen's copy, as oneDNN would copy it itself."""
    if a.is_contiguous():
        return a
    copy = native.transposed(a.t()) if a.dim() == 2 else None
    return a.contiguous() if copy is None else copy


def pack(weight: Tensor, *, rows: int = 32) -> Tensor | None:
    """A linear weight (N, K) in oneDNN's own layout, for products of about `rows` rows (a
    pass's steps: the batch), or None where it does not lie contiguous and the native kernel
    cannot transpose it into contiguity (`native.transposed`). In the training step, the
    LSTM's per-word products by the packed weight took 3.6 ms a step against 5.9 by the plain
    one (32 × 1024 × 2048), for a packing of about 0.5 ms; packing a transposed weight as it
    lies cost eight times as much, and ATen's transposing copy first 0.9 ms
    (docs/benchmarks.md, parts 23 and 24)."""
    with torch.no_grad():
        weight = weight.detach()
        if not weight.is_contiguous():
            weight = native.transposed(weight.t()) if weight.dim() == 2 else None
            if weight is None:
                return None
        return torch.ops.mkldnn._reorder_linear_weight(weight, rows)


def _best_of_three(fn: Callable[[], Any]) -> float:
    fn()  # oneDNN builds its kernel
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


@functools.cache
def onednn_is_faster() -> bool:
    """Whether oneDNN runs this machine's float32 products faster than ATen's BLAS (MKL),
    timed once a process at a weight gradient's shape, G^T X with G (1024, 1024) and X
    (1024, 512), best of three (about 40 ms); oneDNN only where it is 1.25× as fast, so that
    the choice does not flip from run to run near a tie. The answer depends on the CPU: on an
    AMD Zen 5, whose MKL took the AVX2 path, oneDNN ran such products about twice as fast,
    where on a Zen 4 MKL ran weight gradients 12% faster (docs/benchmarks.md, parts 9 and 23)."""
    gen = torch.Generator().manual_seed(0)  # not the global stream
    g, x = torch.rand(1024, 1024, generator=gen), torch.rand(1024, 512, generator=gen)
    with torch.autocast("cpu", enabled=False):  # the verdict holds for the process
        if not onednn_usable(g):
            return False
        ours, blas = _best_of_three(lambda: mm(g.t(), x)), _best_of_three(lambda: g.t() @ x)
    faster = ours < blas / 1.25  # by a clear margin only: near a tie, the choice could flip
    log.info("float32 products of a pass by %s: oneDNN %.2f ms, ATen %.2f ms",
             "oneDNN" if faster else "ATen", ours * 1e3, blas * 1e3)
    return faster


#: A product of at least this many rows reads its weight packed first (`pack`): at the keys'
#: 6272 rows (32 × 196, 512 × 512) it took 6.56 ms against 7.46, for 0.14 ms of packing; at a
#: pass's few hundred word rows the packing costs what it saves (docs/benchmarks.md, part 24).
PACK_ROWS = 2048


class _OneDNNLinear(torch.autograd.Function):
    """F.linear with its forward product by oneDNN (the bias added in the product, not copied
    into the output first), its weight packed first for `PACK_ROWS` rows or more; the
    backward's products by oneDNN where it is the faster here (`onednn_is_faster`), else by
    ATen."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor,  # type: ignore[override]
                bias: Tensor | None) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.numel() // max(1, x.size(-1))
        packed = pack(weight, rows=rows) if rows >= PACK_ROWS else None
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight if packed is None
                                                  else packed, bias, "none", [], "")

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        x, weight = ctx.saved_tensors
        g2 = g.reshape(-1, g.size(-1))  # (n, out)
        want_x, want_w, want_b = ctx.needs_input_grad
        fast = onednn_is_faster()
        dx = mm(g2, weight, onednn=fast).view(x.shape) if want_x else None
        dw = (mm(g2.t(), x.reshape(-1, x.size(-1)), onednn=fast)  # (out, in), as W lies
              if want_w else None)
        return dx, dw, (g2.sum(0) if want_b and ctx.has_bias else None)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None, *,
           onednn: bool = False) -> Tensor:
    """F.linear. `onednn`: a float32 product by oneDNN where it takes it (`onednn_usable`): at a
    pass's thousands of rows (the keys of a batch's grids) 12% faster than MKL's on this
    project's CPU, with no copy of the bias into the output (docs/benchmarks.md, part 9); equal
    to F.linear's to float32 rounding (the decoder's loss on the native path to 1e-5). oneDNN
    builds a kernel for each new shape (0.3 to 0.4 ms, and memory kept): a pass's word count
    changes with every batch, which cost about 1.3% of a run (docs/benchmarks.md, part 23)."""
    if onednn and _takes(x, weight):
        return _OneDNNLinear.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def linear_layer(layer: torch.nn.Linear, x: Tensor, *, onednn: bool = False) -> Tensor:
    """layer(x); `onednn`: by oneDNN where it takes the product (`linear`), which does not run
    the layer's hooks."""
    if onednn and _takes(x, layer.weight):
        return _OneDNNLinear.apply(x, layer.weight, layer.bias)
    return layer(x)


def _takes(x: Tensor, weight: Tensor) -> bool:
    """Whether oneDNN takes the product of `x` by `weight` here (float32, `onednn_usable`)."""
    return x.dtype == torch.float32 and onednn_usable(weight)


class _Step(torch.autograd.Function):
    """addmm(bias, x, W), or x W without a bias, whose backward gives the gradients of bias
    and x, and hands x and the output's gradient to W's `PassGradient`. `onednn`: x W and
    g W^T by oneDNN, which reads W as it lies (`RecurrentProduct`)."""

    @staticmethod
    def forward(ctx: Any, bias: Tensor | None, x: Tensor,  # type: ignore[override]
                weight: Tensor, sink: PassGradient, onednn: bool,
                packed: tuple[Tensor | None, Tensor | None] = (None, None)) -> Tensor:
        ctx.save_for_backward(x, weight)
        ctx.sink, ctx.onednn, ctx.packed = sink, onednn, packed[1]
        ctx.dtypes = (None if bias is None else bias.dtype, x.dtype)
        if onednn:  # x W (+ bias), W^T (N, K) as the (out, in) weight, or its `packed` form
            w = weight.t() if packed[0] is None else packed[0]
            if bias is None:
                return torch.ops.mkldnn._linear_pointwise(x.contiguous(), w, None, "none", [], "")
            return torch.ops.mkldnn._linear_pointwise.binary(  # bias (b, N) or (N,), as addmm's
                x.contiguous(), bias.expand(x.size(0), -1).contiguous(), w, None, "add")
        if bias is None:
            return torch.mm(x, weight)
        return torch.addmm(bias, x, weight)  # under autocast, in its dtype

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor | None, Tensor, None, None, None, None]:
        x, weight = ctx.saved_tensors
        ctx.sink.add_product(x, g)
        bias_dtype, x_dtype = ctx.dtypes
        if ctx.onednn:  # g W^T, W (K, N) as the (out, in) weight, or its `packed` form
            w = weight if ctx.packed is None else ctx.packed
            dx = torch.ops.mkldnn._linear_pointwise(g.contiguous(), w, None, "none", [], "")
        else:
            dx = g @ weight.t().to(g.dtype)
        return ((None if bias_dtype is None else g.to(bias_dtype)), dx.to(x_dtype),
                None, None, None, None)


class RecurrentProduct:
    """bias_t + x_t W for every step of one pass (`__call__`), W's gradient formed once as
    X^T G: the LSTM's [ẑ_t, h_{t-1}] W, and the scorer's query h_{t-1} W_q^T. `defer` False (a
    compiled pass) makes it a plain addmm (mm without a bias).

    `onednn`: each step's float32 products (x W, and g W^T backward) by oneDNN where it can
    take them. ATen runs float32 products by MKL's sgemm, which at a step's few rows was much
    slower than oneDNN on this project's AMD CPU (32 × 1024 × 2048: 1.14 against 0.75 ms, W as
    it lies; docs/benchmarks.md). Within 1e-6 relative of MKL's results (the decoder's loss is
    tested to 1e-5). One per pass. W's gradient, summed over the pass, goes to oneDNN too where
    it is the faster here (`onednn_is_faster`). The steps' products read W packed once a pass
    into oneDNN's own layout (`pack`), W^T for the forward and W for the backward: one of the
    two lies transposed, and is packed where the native kernel transposes it."""

    def __init__(self, weight: Tensor, *, defer: bool = True, onednn: bool = False) -> None:
        onednn = onednn and onednn_usable(weight)
        self.weight, self.grad = PassGradient.through(
            weight, defer=defer, onednn=onednn and onednn_is_faster(),
            dtype=autocast_dtype(weight))
        self.onednn = onednn and self.grad is not None
        self.packed = ((pack(self.weight.t()), pack(self.weight)) if self.onednn
                       else (None, None))  # (forward's, backward's)

    def __call__(self, bias: Tensor | None, x: Tensor) -> Tensor:
        """bias (b, N) + x (b, K) @ W (K, N); x W where `bias` is None."""
        if self.grad is None:
            return torch.mm(x, self.weight) if bias is None else torch.addmm(bias, x, self.weight)
        return _Step.apply(bias, x, self.weight, self.grad, self.onednn, self.packed)


class _LSTMPassWeights(torch.autograd.Function):
    """nn.LSTMCell's weights as a pass uses them; the backward writes each parameter's gradient
    once (slicing and concatenating them would zero-fill a (4H, E + D) gradient per slice, copy
    transposed parts into it and add the two)."""

    @staticmethod
    def forward(ctx: Any, weight_ih: Tensor, weight_hh: Tensor,  # type: ignore[override]
                E: int) -> tuple[Tensor, Tensor]:
        ctx.E = E
        # (4H, E), a copy: the word gates' product then gives its gradient in this layout too
        word = weight_ih[:, :E].contiguous()
        recurrent = torch.cat([weight_ih[:, E:], weight_hh], dim=1).t()  # (D + H, 4H)
        return word, recurrent

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g_word: Tensor, g_recurrent: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor, None]:
        E = ctx.E
        rec = g_recurrent.t()  # (4H, D + H)
        H = rec.size(0) // 4
        D = rec.size(1) - H
        grad_ih = rec.new_empty(rec.size(0), E + D)
        grad_ih[:, :E] = g_word
        grad_ih[:, E:] = rec[:, :D]
        return grad_ih, rec[:, D:].contiguous(), None


def lstm_pass_weights(weight_ih: Tensor, weight_hh: Tensor, E: int) -> tuple[Tensor, Tensor]:
    """(the word part W_y (4H, E), [W_z | W_hh]^T (D + H, 4H)) of nn.LSTMCell's weight_ih
    (4H, E + D) and weight_hh (4H, H), made once a pass: the gates' part from the previous
    word, and the one product a step takes from ẑ_t and h_{t-1}."""
    return _LSTMPassWeights.apply(weight_ih, weight_hh, E)
