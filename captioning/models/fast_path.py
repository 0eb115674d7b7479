"""Which teacher-forcing path a decoder runs, by device (`AttentionLSTMDecoder.use_fast_path`).

* `off`: the eager loop over shrinking batches, the score by ATen operations;
* `native`: that loop with attention's native CPU kernels (`captioning.models.native`);
* `compile`: every caption for a fixed number of steps, fused by `torch.compile`;
* `graphs`: the same, replayed as CUDA graphs (`reduce-overhead`).
"""

from __future__ import annotations

from typing import Literal

import torch

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
