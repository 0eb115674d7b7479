"""Which teacher-forcing path a decoder runs, by device (`AttentionLSTMDecoder.use_fast_path`).

* `off`: the eager loop over shrinking batches, the score by ATen operations;
* `native`: that loop with attention's native CPU kernels (`captioning.models.native`);
* `compile`: every caption for a fixed number of steps, fused by `torch.compile`;
* `graphs`: the same, replayed as CUDA graphs (`reduce-overhead`).

`FixedPass` holds the compiled pass and the shapes it is called at.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from typing import Any, Literal

import torch
from torch import Tensor

from captioning.choices import check_choice

log = logging.getLogger(__name__)

FastPath = Literal["off", "native", "compile", "graphs"]
# auto: graphs on CUDA (soft attention), native on the CPU
FastPathSetting = Literal["auto", "off", "native", "compile", "graphs"]


def resolve_fast_path(setting: str, device: torch.device, attention: str = "soft", *,
                      accumulate: int = 1) -> FastPath:
    """The fast path for a device: `auto` is `graphs` for soft attention on CUDA and `native`
    on the CPU, where each was measured faster with soft attention (docs/benchmarks.md; on the
    CPU hard attention scores by the same kernel), and `off` elsewhere (hard attention's
    sampled passes were not measured on a GPU). `native` is a CPU kernel: `off` on other
    devices. The others stand as given, except `graphs` where gradients are summed over
    `accumulate` > 1 batches: `compile` then. A parameter's first gradient would be the
    graphs' output itself, which the next batch's replay overwrites (pytorch/pytorch#169545)."""
    if setting == "auto":
        if device.type == "cpu":
            return "native"
        setting = "graphs" if device.type == "cuda" and attention == "soft" else "off"
    check_choice("fast_path", setting, FastPathSetting)
    if setting == "native" and device.type != "cpu":
        return "off"
    if setting == "graphs" and accumulate > 1:
        log.info("fast_path: compile, not graphs: gradients are accumulated over %d batches, "
                 "which CUDA graphs' outputs do not survive", accumulate)
        return "compile"
    return setting  # type: ignore[return-value]


# Compiled graphs the fixed-shape pass may hold: one per length bucket. Dynamo's default, 8 a
# function, holds COCO's 7 buckets (50-word captions at `fast_bucket` 8) but not a smaller
# bucket's; past it every further bucket would run eagerly, unrolled.
GRAPH_ROOM = 64


def _compile_options() -> dict[str, Any]:
    """`torch.compile`'s own recompile limit where it takes one (torch 2.14 does): room for
    `GRAPH_ROOM` graphs, counted for this pass alone. Older versions keep dynamo's default."""
    taken = inspect.signature(torch.compile).parameters
    if "recompile_limit" not in taken or "isolate_recompiles" not in taken:
        return {}
    return {"recompile_limit": GRAPH_ROOM, "isolate_recompiles": True}


COMPILE_OPTIONS = _compile_options()  # read once, from torch's own signature


class FixedPass:
    """The teacher-forced pass compiled over fixed shapes (`graphs`: as CUDA graphs), called
    with a batch's rows padded up to the most it has had (`rows`, which only grows), so that an
    epoch's smaller last batch replays its bucket's graph instead of compiling one more."""

    def __init__(self, fn: Callable[..., tuple[Tensor | None, ...]], *, graphs: bool) -> None:
        self.fn = torch.compile(fn, dynamic=False, mode="reduce-overhead" if graphs else None,
                                **COMPILE_OPTIONS)
        self.most = 0  # rows

    def rows(self, batch: int) -> int:
        """The rows to run a batch of `batch` at: the most seen, this one's too."""
        self.most = max(batch, self.most)
        return self.most

    def __call__(self, *args: Any) -> tuple[Tensor | None, ...]:
        return self.fn(*args)


def pad_rows(x: Tensor | None, rows: int) -> Tensor | None:
    """x (B, ...) followed by rows - B rows of zeros (False, the pad id): (rows, ...), and
    contiguous: the compiled pass guards on strides too (a slice of a wider batch, or the
    batch-wide coin expanded, would compile its bucket once more)."""
    if x is None or x.size(0) == rows:
        return None if x is None else x.contiguous()
    return torch.cat([x, x.new_zeros(rows - x.size(0), *x.shape[1:])])
