"""Native CPU kernels for a decoder step's elementwise work (attention's score and context, the
LSTM cell) and for what a training step spends outside its products (a transposing copy,
dropout masks), compiled on this machine on first use.

On the CPU, the additive score w^T tanh(k_i + q) (Eq. 4) is the largest cost of a training step
after the products: its elementwise work over the (b, L, A) grid at every word is bound by
memory traffic, as is the context Σ_i w_i a_i (Eq. 6) over the (b, L, D) annotations.
`AdditiveScore` (captioning.models.attention) runs the score as ATen operations, which pass over
a (b, L, A) tensor twice forward and five times backward. `attention.cpp` makes one pass each
way (tanh by a rational function, recomputed in the backward rather than stored), in
float32 or bfloat16: in float32 it equals the formula to 1e-5, in
bfloat16 it is as near it as the ATen ops (`tests/test_native.py`). Both kernels read the grid
through `rows` (caption c reads row rows[c]), so that the captions of one image read its keys
and annotations once, from cache, and sum the keys' gradient into one row: the decoder's
teacher-forced pass keeps one row per distinct image (`Memory.rows`). `cell.cpp` runs the LSTM
cell's elementwise update (Eqs. 1-3) in one operation each way, where autograd takes some twenty
(`lstm_cell`), in float32, in the teacher-forced pass and in every decoding step alike.
`layout.cpp` copies a float32 matrix transposed on every thread (`transposed`: a weight
gradient's G^T before oneDNN's product, a weight before its packing), and `dropout.cpp` draws
F.dropout's masks from torch's own generator, bit for bit, in bulk (`dropout_mask`). These two
are used only where the kernels are already loaded (`loaded`), never built for them.

`available()` loads them once per process, building with `torch.utils.cpp_extension` (a C++
compiler and ninja) where they are not built yet: 10 to 30 s, once per machine, torch version
and source. They are built for the vector width torch runs at here
(`torch.backends.cpu.get_cpu_capability()`), into a folder of torch's extension folder
(`$TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions) named by that width and a digest
of torch's version, the flags and the sources, which are copied there: checkouts with the same
sources share one build. Builds are serialised by a file lock that dies with its holder
(`captioning.locks`), so a build killed halfway never blocks the next. Where they cannot be
built, `available()` logs one warning and returns False; the caller runs the ATen ops. The
decoder uses them through `fast_path: native`, which `auto` picks on the CPU.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor

from captioning.atomic import write_text_atomic
from captioning.locks import exclusive_lock

log = logging.getLogger(__name__)

#: The kernels' sources: attention's score and context, the LSTM cell, the transposing copy
#: and the dropout masks.
SOURCES = tuple(Path(__file__).with_name(name)
                for name in ("attention.cpp", "cell.cpp", "layout.cpp", "dropout.cpp"))
DTYPES = (torch.float32, torch.bfloat16)  # the kernels' grids; others run the ATen ops
#: The context's annotations may also be float16: a cached grid, read as the float32 it holds.
VALUE_DTYPES = (*DTYPES, torch.float16)

#: Compiler flags for each vector width torch reports (ATen's own Vectorized types follow them).
_ARCH_FLAGS = {
    "AVX512": ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma",
               "-DCPU_CAPABILITY_AVX512", "-DCPU_CAPABILITY=AVX512"],
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY_AVX2", "-DCPU_CAPABILITY=AVX2"],
}


def build_flags() -> tuple[str, list[str]]:
    """(the extension's name, its compiler flags) for this machine's vector width. The name
    ends in a digest of torch's version, the flags and the sources: a build of other headers or
    other sources is never loaded."""
    capability = torch.backends.cpu.get_cpu_capability()
    arch = _ARCH_FLAGS.get(capability, ["-DCPU_CAPABILITY=DEFAULT"])
    flags = ["-O3", "-fopenmp", *arch]
    digest = hashlib.sha256("\0".join([torch.__version__, str(torch.version.git_version),
                                       *flags, *(f.read_text() for f in SOURCES)]).encode()
                            ).hexdigest()[:12]
    width = capability.lower() if capability in _ARCH_FLAGS else "default"
    return f"captioning_native_{width}_{digest}", flags


@contextlib.contextmanager
def _ninja_on_path() -> Iterator[None]:
    """cpp_extension runs `ninja` from PATH; a virtual environment's own (the `ninja` package)
    is not there unless the environment is activated."""
    here = Path(sys.executable).parent
    if shutil.which("ninja") is not None or not (here / "ninja").exists():
        yield
        return
    old = os.environ.get("PATH")
    os.environ["PATH"] = os.pathsep.join(filter(None, [str(here), old]))
    try:
        yield
    finally:
        if old is None:
            del os.environ["PATH"]
        else:
            os.environ["PATH"] = old


def extensions_root() -> Path:
    """torch's extension folder: `$TORCH_EXTENSIONS_DIR`, else its per-user default."""
    from torch.utils import cpp_extension

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or cpp_extension.get_default_build_root())


def build(build_root: Path | None = None) -> None:
    """Compile (or find compiled) and load the kernels into `torch.ops.captioning_native`."""
    cpp_log = logging.getLogger("torch.utils.cpp_extension")
    level = cpp_log.level
    cpp_log.setLevel(logging.ERROR)  # its import warns that no CUDA runtime is found
    try:
        from torch.utils import cpp_extension
    finally:
        cpp_log.setLevel(level)
    name, flags = build_flags()
    root = Path(build_root or extensions_root())
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    if not any(folder.glob(f"{name}*.so")):
        log.info("building the native CPU attention kernels (once per machine, 10 to 30 s)")
    start = time.monotonic()
    with exclusive_lock(folder) as locked, _ninja_on_path():
        if locked:
            # cpp_extension's own lock file, left behind by a killed build: older torch
            # releases wait while it exists. Stale, since every build here holds our lock.
            (folder / "lock").unlink(missing_ok=True)
        sources = [folder / f.name for f in SOURCES]  # one path for every checkout: ninja
        for source, original in zip(sources, SOURCES):  # sees no change
            text = original.read_text()
            if not source.exists() or source.read_text() != text:
                write_text_atomic(source, text)
        cpp_extension.load(name=name, sources=[str(f) for f in sources], extra_cflags=flags,
                           extra_ldflags=["-fopenmp"], build_directory=str(folder),
                           is_python_module=False, verbose=False)
    log.debug("native CPU kernels loaded in %.1f s (%s)", time.monotonic() - start, folder)


def loaded() -> bool:
    """Whether the kernels are loaded in this process (`available` loads them)."""
    return hasattr(torch.ops.captioning_native, "transposed")


@functools.cache
def available() -> bool:
    """Whether the kernels are loaded, building them on the first call; False, with one
    warning, where they cannot be built."""
    if loaded():
        return True
    try:
        build()
    except Exception as err:  # no compiler, no ninja, no headers: the ATen ops instead
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        log.warning("the native CPU kernels could not be built (%s); training uses the "
                    "slower ATen operations instead", first)
        return False
    return True


def usable(grid: Tensor, *, values: bool = False) -> bool:
    """Whether the kernels can read this grid: built, on the CPU, float32 or bfloat16; float16
    too for the context's annotations (`values`). Never while `torch.compile` traces: it cannot
    see into the kernels, so a compiled step traces the ATen ops in their place."""
    return (not torch.compiler.is_compiling() and grid.device.type == "cpu"
            and grid.dtype in (VALUE_DTYPES if values else DTYPES) and available())


def flop_formulas() -> dict[Any, Any]:
    """`FlopCounterMode`'s `custom_mapping` for the loaded kernels ({} before they load): the
    FLOPs it counts for the ATen operations they replace, so that a CPU pass counts the same
    on the native path as `off`. Per caption, L locations: the score w^T tanh(.) 2·L·A each
    way (backward, w's gradient; its input's is a broadcast product, which ATen's count leaves
    out too); the context 2·L·D each way (the weights' gradient only). The cell is
    elementwise, uncounted."""
    if not hasattr(torch.ops.captioning_native, "lstm_cell"):
        return {}
    ops = torch.ops.captioning_native

    def per_location(factor: int, *, captions: int, grid: int) -> Callable[..., int]:
        """factor · b · L · (A or D), from the arguments' shapes: `captions` the one whose
        first size is b, `grid` the keys (N, L, A) or annotations (N, L, D)."""
        def count(*shapes: Any, **kwargs: Any) -> int:
            return factor * shapes[captions][0] * shapes[grid][1] * shapes[grid][2]
        return count

    return {ops.additive_score: per_location(2, captions=1, grid=0),  # (keys, q, ...)
            ops.additive_score_backward: per_location(2, captions=0, grid=1),  # (g, keys, ...)
            ops.attention_context: per_location(2, captions=0, grid=1),  # (weights, values, .)
            ops.attention_context_backward: per_location(2, captions=0, grid=1)}  # (dz, ...)


def transposed(t: Tensor) -> Tensor | None:
    """t^T, contiguous, of a contiguous 2-D float32 CPU tensor t, by the kernel (layout.cpp):
    its two threads transpose 16 × 16 tiles in vector registers, where ATen's transposing copy
    runs on one, element by element (the keys' gradient of a batch, 6272 × 512: 0.28 against
    1.6 ms, caches flushed; docs/benchmarks.md, part 24). None where the kernels are not loaded
    (`loaded`: this never builds them) or do not take t."""
    if not (loaded() and t.dim() == 2 and t.dtype == torch.float32 and t.device.type == "cpu"
            and t.is_contiguous() and not torch.compiler.is_compiling()):
        return None
    return torch.ops.captioning_native.transposed(t)


def dropout_mask(shape: tuple[int, ...], keep: float,
                 generator: torch.Generator | None = None) -> Tensor | None:
    """The float32 CPU mask F.dropout draws for `shape` (1 / keep where kept, else 0), by the
    kernel (dropout.cpp): the same draws from the same stream (`generator`, by default torch's
    CPU generator), left advanced alike, where ATen's one draw at a time took about 25 times
    as long (32 × 12 × 512: 1.8 against 0.07 ms; docs/benchmarks.md, part 24). None where the
    kernels are not loaded (`loaded`: this never builds them)."""
    if not loaded() or torch.compiler.is_compiling():
        return None
    return torch.ops.captioning_native.dropout_mask(list(shape), keep, generator)


class RunningSum(Protocol):
    """Where the steps of a pass sum the keys' gradient (`pass_grads.PassGradient`)."""

    def running_sum(self, dtype: torch.dtype) -> Tensor:
        """The sum itself, zero-filled once a pass, for the kernel to add into in place."""
        ...


class NativeAdditiveScore(torch.autograd.Function):
    """`AdditiveScore` by the native kernel: the same arguments and results, and `rows` (b,)
    where caption c scores keys[rows[c]] (None: keys[c], the first b rows)."""

    @staticmethod
    def forward(ctx: Any, keys: Tensor, q: Tensor, w: Tensor,  # type: ignore[override]
                keys_grad: RunningSum | None, rows: Tensor | None) -> Tensor:
        keys, q, w1 = keys.contiguous(), q.contiguous(), w.reshape(-1)
        ctx.save_for_backward(keys, q, w1)
        ctx.keys_grad, ctx.w_shape, ctx.rows = keys_grad, w.shape, rows
        return torch.ops.captioning_native.additive_score(keys, q, w1, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, g: Tensor  # type: ignore[override]
                 ) -> tuple[Tensor | None, Tensor, Tensor, None, None]:
        keys, q, w1 = ctx.saved_tensors
        sink: RunningSum | None = ctx.keys_grad
        # rows no caption reads get no gradient: a zero-filled tensor, or the pass's sum
        dkeys = keys.new_zeros(keys.shape) if sink is None else sink.running_sum(keys.dtype)
        dq, dw = torch.ops.captioning_native.additive_score_backward(
            g.contiguous(), keys, q, w1, ctx.rows, dkeys)
        dw = dw.view(ctx.w_shape).to(w1.dtype)
        return (None if sink is not None else dkeys), dq.to(q.dtype), dw, None, None


class NativeContext(torch.autograd.Function):
    """z_c = Σ_i w_ci a_{rows[c], i} (Eq. 6): weights (b, L) and annotations (N, L, D) that take
    no gradient (a frozen grid) -> (b, D) in the annotations' dtype (float32 for float16, whose
    values it reads exactly); the gradient of the weights only."""

    @staticmethod
    def forward(ctx: Any, weights: Tensor, values: Tensor,  # type: ignore[override]
                rows: Tensor | None) -> Tensor:
        if values.requires_grad:
            raise ValueError("NativeContext gives no gradient of the annotations")
        values = values.contiguous()
        ctx.save_for_backward(values)
        ctx.rows, ctx.dtype = rows, weights.dtype
        return torch.ops.captioning_native.attention_context(weights, values, rows)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dz: Tensor) -> tuple[Tensor, None, None]:  # type: ignore[override]
        (values,) = ctx.saved_tensors
        dw = torch.ops.captioning_native.attention_context_backward(dz, values, ctx.rows)
        return dw.to(ctx.dtype), None, None


class NativeLSTMCell(torch.autograd.Function):
    """nn.LSTMCell's update from its gates' pre-activations (b, 4H) and c (b, H), float32, by
    the kernel (cell.cpp): (h, c), each way in one operation."""

    @staticmethod
    def forward(ctx: Any, gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        c = c.contiguous()
        h, c_new, acts = torch.ops.captioning_native.lstm_cell(gates.contiguous(), c)
        ctx.save_for_backward(acts, c)
        ctx.set_materialize_grads(False)  # a step's c (or h) may reach nothing
        return h, c_new

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, dh: Tensor | None, dc: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor]:
        acts, c = ctx.saved_tensors
        return torch.ops.captioning_native.lstm_cell_backward(dh, dc, acts, c)


def lstm_cell(gates: Tensor, c: Tensor, *, kernel: bool = False) -> tuple[Tensor, Tensor]:
    """(h, c) of nn.LSTMCell from its gates' pre-activations (b, 4H), order i, f, g, o, and c
    (b, H) (Eqs. 1-3). `kernel`: by `NativeLSTMCell` where it takes them (float32 CPU tensors,
    built kernels); else ATen's operations."""
    if kernel and gates.dtype == c.dtype == torch.float32 and usable(gates):
        return NativeLSTMCell.apply(gates, c)
    i, f, g, o = gates.chunk(4, dim=1)
    c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
    return torch.sigmoid(o) * torch.tanh(c), c
