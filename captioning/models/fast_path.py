"""Which teacher-forcing path a decoder runs, by device (`AttentionLSTMDecoder.use_fast_path`).

* `off`: the eager loop over shrinking batches, the score by ATen operations;
* `native`: that loop with attention's native CPU kernels (`captioning.models.native`);
* `compile`: every caption for a fixed number of steps, fused by `torch.compile`;
* `graphs`: the same, replayed as CUDA graphs (`reduce-overhead`).

`FixedPass` holds the compiled pass and the shapes it is called at.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from captioning.choices import check_choice

FastPath = Literal["off", "native", "compile", "graphs"]
# auto: graphs on CUDA (soft attention), native on the CPU
FastPathSetting = Literal["auto", "off", "native", "compile", "graphs"]


def resolve_fast_path(setting: str, device: torch.device, attention: str = "soft") -> FastPath:
    """The fast path for a device: `auto` is `graphs` for soft attention on CUDA and `native`
    on the CPU, where each was measured faster with soft attention (docs/benchmarks.md; on the
    CPU hard attention scores by the same kernel), and `off` elsewhere (hard attention's
    sampled passes were not measured on a GPU). `native` is a CPU kernel: `off` on other
    devices. The others stand as given."""
    if setting == "auto":
        if device.type == "cpu":
            return "native"
        return "graphs" if device.type == "cuda" and attention == "soft" else "off"
    check_choice("fast_path", setting, FastPathSetting)
    if setting == "native" and device.type != "cpu":
        return "off"
    return setting  # type: ignore[return-value]


# Compiled graphs the fixed-shape pass may hold: one per length bucket and mode (training,
# validation). Dynamo's default limit, 8 a function, is below that for COCO's 50-word captions
# at bucket 8 (7 buckets, 2 modes), and past it every further bucket runs eagerly, unrolled.
GRAPH_ROOM = 64


class FixedPass:
    """The teacher-forced pass compiled over fixed shapes (`graphs`: as CUDA graphs), called
    with a batch's rows padded up to the most its mode has had (`rows`), so that an epoch's
    smaller last batch replays its bucket's graph instead of compiling one more."""

    def __init__(self, fn: Callable[..., tuple[Tensor | None, ...]], *, graphs: bool) -> None:
        self.fn = torch.compile(fn, dynamic=False, mode="reduce-overhead" if graphs else None)
        self.most: dict[tuple[bool, bool], int] = {}  # (training, grad): rows

    def rows(self, batch: int, *, training: bool) -> int:
        """The rows to run a batch of `batch` at: the most seen in this mode, this one too."""
        key = (training, torch.is_grad_enabled())
        self.most[key] = rows = max(batch, self.most.get(key, 0))
        return rows

    def __call__(self, *args: Any) -> tuple[Tensor | None, ...]:
        config = torch.compiler.config  # set and put back by hand: `patch` costs 2x (~25 µs)
        limit = config.recompile_limit
        config.recompile_limit = max(GRAPH_ROOM, limit)
        try:
            return self.fn(*args)
        finally:
            config.recompile_limit = limit


def pad_rows(x: Tensor | None, rows: int) -> Tensor | None:
    """x (B, ...) followed by rows - B rows of zeros (False, the pad id): (rows, ...), and
    contiguous: the compiled pass guards on strides too (a slice of a wider batch, or the
    batch-wide coin expanded, would compile its bucket once more)."""
    if x is None or x.size(0) == rows:
        return None if x is None else x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.size(0), *x.shape[1:])])
