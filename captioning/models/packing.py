"""The word positions of a teacher-forced pass, packed: only those before each caption's end.

A batch of B captions sorted longest first runs, at word step t, only its first b_t captions
(those still going). `PackedSteps` lists those (caption, step) positions time-major, N = Σ_t b_t
of them, so that the products over every position (the LSTM's word gates, the deep output) run
on the N real positions and none of the (B, T) batch's padding, and the per-step outputs of the
loop, (b_t, ...) each, concatenate into the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cache
from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import Tensor

import captioning.models.native as native
from captioning.models.attention import Selection


@dataclass(frozen=True, eq=False)
class PackedSteps:
    """Time-major positions of captions sorted longest first: `running[t]` = b_t, and `index`
    (N,) the flat position r · T + t of each in the (B, T) batch as given, r the sorted
    caption's row there."""

    batch: int  # B
    steps: int  # T, the longest caption's word steps
    running: tuple[int, ...]  # b_t, captions still going at step t (non-increasing)
    index: Tensor  # (N,) long

    @classmethod
    def of(cls, steps: list[int], *, rows: list[int] | None = None,
           device: torch.device) -> PackedSteps:
        """From each caption's word steps, sorted longest first, and each one's row in the
        batch as given (`rows`; by default the batch is given sorted)."""
        if any(a < b for a, b in pairwise(steps)):
            raise ValueError("PackedSteps needs the captions sorted longest first")
        B, T = len(steps), max(steps, default=0)
        going = torch.arange(T).unsqueeze(1) < torch.tensor(steps, dtype=torch.long)  # (T, B)
        tb = going.nonzero()  # (N, 2): (t, b), t-major
        row = torch.arange(B) if rows is None else torch.tensor(rows, dtype=torch.long)
        return cls(B, T, tuple(going.sum(1).tolist()), (row[tb[:, 1]] * T + tb[:, 0]).to(device))

    def gather(self, x: Tensor) -> Tensor:
        """(B, T, ...) -> (N, ...): the packed positions of a batch-first tensor."""
        if tuple(x.shape[:2]) != (self.batch, self.steps):
            raise ValueError(f"expected ({self.batch}, {self.steps}, ...), got {tuple(x.shape)}")
        return x.reshape(self.batch * self.steps, *x.shape[2:]).index_select(0, self.index)

    def scatter(self, packed: Tensor) -> Tensor:
        """(N, ...) -> (B, T, ...), zero at the padding."""
        out = packed.new_zeros(self.batch * self.steps, *packed.shape[1:])
        return out.index_copy(0, self.index, packed).view(self.batch, self.steps,
                                                          *packed.shape[1:])

    def padded(self, rows: list[Tensor]) -> Tensor:
        """Per-step rows (b_t, ...), one tensor a step, -> (B, T, ...), zero at the padding."""
        return self.scatter(torch.cat(rows))

    def dropout(self, p: float, training: bool) -> Callable[[Tensor], Tensor]:
        """Dropout of packed rows (N, C), with the mask that `F.dropout` (nn.Dropout) draws for
        the padded (B, T, C) batch, in the rows' dtype and device: from one seed, the same units
        drop whether the padding is packed away or not."""
        def drop(x: Tensor) -> Tensor:
            if not training or p == 0:
                return x
            mask = dropout_mask((self.batch, self.steps, x.size(-1)), p, dtype=x.dtype,
                                device=x.device)
            return x * self.gather(mask)
        return drop


def dropout_mask(shape: tuple[int, ...], p: float, *, dtype: torch.dtype,
                 device: torch.device) -> Tensor:
    """The mask `F.dropout(ones(shape), p, training=True)` draws, 0 or 1 / (1 - p), bit for
    bit and from the same random numbers. Where ATen's CPU Bernoulli draws one uniform double
    an element (`serial_cpu_bernoulli`), `torch.rand` draws those doubles about 3x faster than
    `bernoulli_` (docs/benchmarks.md, part 8), and the native kernel a float32 mask from them
    25 times faster again (`native.dropout_mask`, where it is loaded and draws exactly those:
    `native_masks_exact`); p = 0 and p = 1 are F.dropout's own."""
    keep = 1.0 - p
    if device.type == "cpu" and 0.0 < p < 1.0 and serial_cpu_bernoulli():
        if dtype == torch.float32 and native.loaded() and native_masks_exact(keep):
            mask = native.dropout_mask(shape, keep)
            if mask is not None:
                return mask
        drawn = torch.rand(shape, dtype=torch.float64, device=device) < keep  # bernoulli_'s
        return drawn.to(dtype).div_(keep)  # as F.dropout: the noise in x's dtype, / (1 - p)
    return F.dropout(torch.ones(shape, dtype=dtype, device=device), p, training=True)


@cache
def serial_cpu_bernoulli() -> bool:
    """Whether this build's CPU `bernoulli_(p)` draws u = `torch.rand(dtype=float64)`'s
    double per element and keeps u < p, one at a time (not MKL's generator, which ATen takes
    on Intel CPUs): checked once on a private generator."""
    draws = [torch.Generator().manual_seed(0) for _ in range(2)]
    bern = torch.empty(4096).bernoulli_(0.5, generator=draws[0]).bool()
    rand = torch.rand(4096, dtype=torch.float64, generator=draws[1]) < 0.5
    after = [torch.rand(8, generator=g) for g in draws]  # and both used the stream alike
    return torch.equal(bern, rand) and torch.equal(*after)


@cache
def native_masks_exact(keep: float) -> bool:
    """Whether the native kernel's masks (`native.dropout_mask`) are `torch.rand`'s draws
    below `keep`, 1 / keep as F.dropout scales them, and leave the stream where those draws
    do: checked once a value, on private generators, after an odd number of draws (the twister
    mid-state), for more draws than one state holds. Call only where the kernels are loaded."""
    draws = [torch.Generator().manual_seed(1) for _ in range(2)]
    for g in draws:
        torch.rand(5, generator=g)
    theirs = (torch.rand(3, 701, dtype=torch.float64, generator=draws[0]) < keep).float().div_(keep)
    ours = native.dropout_mask((3, 701), keep, draws[1])
    after = [torch.rand(8, generator=g) for g in draws]
    return ours is not None and torch.equal(ours, theirs) and torch.equal(*after)


@dataclass
class StepTrace:
    """Per-step outputs of a teacher-forced pass, collected in lists and stacked once: writing
    into preallocated (B, T, ...) buffers would make autograd copy the buffer every step."""

    hs: list[Tensor] = field(default_factory=list)  # h_t (b_t, H)
    zs: list[Tensor] = field(default_factory=list)  # ẑ_t (b_t, D)
    alphas: list[Tensor] = field(default_factory=list)  # α_t (b_t, L)
    log_ps: list[Tensor] = field(default_factory=list)  # log p(s_t | a), sampling rules only
    ents: list[Tensor] = field(default_factory=list)  # H[α_t], sampling rules only

    def add(self, h: Tensor, z_hat: Tensor, sel: Selection) -> None:
        self.hs.append(h)
        self.zs.append(z_hat)
        self.alphas.append(sel.alpha)
        if sel.log_prob is not None and sel.entropy is not None:
            self.log_ps.append(sel.log_prob)
            self.ents.append(sel.entropy)
