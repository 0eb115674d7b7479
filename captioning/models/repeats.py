"""Run a function once per distinct row of a batch that repeats rows.

A training batch may hold several captions of one image (`CaptionDataModule(group_by_image=
True)`; COCO has five per image). Their images, or their cached annotation grids, are the same
rows repeated, and so is everything a frozen function computes from them: the CNN's grid
(`Captioner.encode`) and the scorer's keys W_a a_i (`AttentionLSTMDecoder.memory`), the
largest single product of a training step on the CPU. `per_distinct_row` runs such a function
once per distinct row and hands each row its copy: the same values (up to the rounding of a
product over fewer rows), less work.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

#: Entries of each row read for the fingerprint that proposes repeats (then checked in full).
FINGERPRINT_ENTRIES = 4096
#: The integer type of each element size, to read a row's bits.
BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: Repeated rows a batch must hold (at least, and at least an eighth of it) to be merged.
MIN_REPEATS = 4


def repeated_rows(x: Tensor) -> tuple[Tensor, Tensor] | None:
    """(first, inverse) with `x[first][inverse]` equal to `x` (B, ...) entry for entry, where
    `first` (U,) holds one row of each distinct bit pattern; None when too few rows repeat to pay
    (`MIN_REPEATS`), or a fingerprint collision leaves it unproven. Reads it on the host."""
    B = x.size(0)
    if B < 2:
        return None
    flat = x.contiguous().reshape(B, -1)
    bits = flat.view(BITS[flat.element_size()])  # each entry's bits, as an integer
    stride = max(1, bits.size(1) // FINGERPRINT_ENTRIES)
    # An integer sum of the raw bits: equal rows give equal fingerprints, with no rounding.
    fingerprint = bits[:, ::stride].sum(dim=1, dtype=torch.int64)  # (B,)
    _, inverse = torch.unique(fingerprint, return_inverse=True)  # (B,) -> 0 .. U-1
    repeats = B - (int(inverse.max()) + 1)
    if repeats < max(MIN_REPEATS, B // 8):
        return None  # too few repeats to pay for the check and the copies (docs/benchmarks.md)
    rows = torch.arange(B, device=x.device)
    first = torch.full((B - repeats,), B, device=x.device).scatter_reduce(0, inverse, rows, "amin")
    source = first[inverse]
    again = (source != rows).nonzero()[:, 0].tolist()  # rows that repeat an earlier one
    # Bit for bit (0.0 and -0.0 differ, NaN equals itself), row by row: views, where comparing
    # gathered copies would cost three times as long.
    if not all(torch.equal(bits[r], bits[s]) for r, s in zip(again, source[again].tolist())):
        return None  # two different rows share a fingerprint: run on every row
    return first, inverse


def per_distinct_row(x: Tensor, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """`fn(x)` for a row-wise `fn` (B, ...) -> (B, ...), run once per distinct row of `x`.

    Only where `x` needs no gradient (cached features, images, a frozen encoder's grid), so
    that its repeats are copies of one input, and on the CPU: finding the repeats reads a
    result on the host, which a GPU step is built to avoid.
    """
    if x.device.type != "cpu" or (x.requires_grad and torch.is_grad_enabled()):
        return fn(x)
    found = repeated_rows(x)
    if found is None:
        return fn(x)
    first, inverse = found
    # (U, ...) -> (B, ...); index_select's backward is an index_add, 3x faster on the CPU
    # than the accumulating index_put of `[inverse]`.
    return fn(x.index_select(0, first)).index_select(0, inverse)
