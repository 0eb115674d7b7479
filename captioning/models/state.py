"""What a decoder step reads and carries: the memory it attends over and its recurrent state.

Both are tuples of batch-first tensors, the step API's data (`AttentionLSTMDecoder.memory`,
`init_state`, `step`), so that decoding strategies can repeat, reorder and drop captions
without knowing the decoder.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


def grid_dtype(dtype: torch.dtype, weights: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype an annotation grid is computed in: for a float16 grid (a cached one, which
    holds float32 values exactly at half the bytes), the `weights`' dtype (float32, or float16
    for a model cast to half), else its own."""
    return weights if dtype == torch.float16 else dtype


class Memory(NamedTuple):
    """What the decoder attends over; fixed for a caption. Caption i reads row i of `values`
    and `keys`, or, where `rows` is given, row rows[i] (a teacher-forced pass on the native path
    keeps one row per distinct image, which its captions share)."""

    values: Tensor  # (B, L, D) annotation vectors a_i; (N, L, D) with rows
    keys: Tensor  # (B', L, K) the scorer's keys, e.g. W_a a_i, the first B rows used; or (N, L, K)
    rows: Tensor | None = None  # (B,) int64: the row each caption reads

    def first(self, b: int) -> Memory:
        """The memory of the first b captions (the scorer reads the keys' first b rows)."""
        if self.rows is not None:
            return self._replace(rows=self.rows[:b])
        return self._replace(values=self.values[:b])

    def select(self, index: Tensor) -> Memory:
        """The memory of captions `index` (B2,): reordered, repeated or dropped."""
        if self.rows is not None:
            return self._replace(rows=self.rows.index_select(0, index))
        return Memory(self.values.index_select(0, index), self.keys.index_select(0, index))


class DecoderState(NamedTuple):
    """Recurrent state. Every field has the batch first, so beam search can reorder it."""

    h: Tensor  # (B, H)
    c: Tensor  # (B, H)
    location: Tensor  # (B,) location chosen at the last step (argmax α for soft models)
