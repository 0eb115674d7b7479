"""Cached grids held whole on the training device (`CaptionDataModule(features_on_device=True)`).

Each split's float16 grids (`FeatureCache`) are copied once onto the device; the loader hands
over row numbers (`GridRows`), and a batch's (B, L, D) grids are gathered there after the
transfer, so that no grid goes through the loader or the host-to-device copy. On the CPU the
cache's memory map itself serves the rows. Before any copy, grids that do not fit are refused
in one line (`room_problem`); under DDP every rank gives its verdict (`distributed.agreement`), on the room
and on the copy, so that all ranks stop together.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from captioning.data.datasets import GridRows
from captioning.data.features import BLOCK_BYTES, CacheError, FeatureCache, read_only_tensor

log = logging.getLogger(__name__)

Agree = Callable[[bool], bool]  # every process's verdict, all or none (`distributed.agreement`)


def room_problem(nbytes: int, device: torch.device, *, what: str,
                 free_total: tuple[int, int] | None = None) -> str | None:
    """Why `nbytes` do not fit on a CUDA `device` with room left for training (the larger of
    2 GiB and a tenth of its memory), or None. `free_total`: its free and total bytes (default
    `torch.cuda.mem_get_info`, plus what the caching allocator holds unused)."""
    if device.type != "cuda":
        return None
    if free_total is None:
        free, total = torch.cuda.mem_get_info(device)
        free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    else:
        free, total = free_total
    keep = max(2 << 30, total // 10)
    if nbytes <= free - keep:
        return None
    return (f"data.features_on_device: {what} need {nbytes / 1e9:.1f} GB on {device}, which "
            f"has {free / 1e9:.1f} GB free of {total / 1e9:.1f} GB and keeps {keep / 1e9:.1f} GB "
            "for training; set data.features_on_device false to read them through the loader")


def copy_in_chunks(array: np.ndarray, out: Tensor, rows: int) -> None:
    """`out[:] = array`, `rows` rows at a time (pageable and synchronous, so that no more than
    a chunk of a memory-mapped file is read ahead)."""
    if out.shape != array.shape:
        raise ValueError(f"cannot copy {array.shape} rows into {tuple(out.shape)}")
    for start in range(0, len(out), rows):
        out[start:start + rows].copy_(read_only_tensor(array[start:start + rows]))


def to_device(cache: FeatureCache, device: torch.device, *, chunk_rows: int | None = None
              ) -> Tensor:
    """The cache's whole (N, L, D) float16 array as one tensor on `device`, every block hashed
    first where its `verify` is lazy (every row is read). On the CPU the read-only map itself
    (no copy; never write into it); elsewhere a copy, `chunk_rows` rows at a time (default:
    about 64 MiB)."""
    cache.check_every_block()
    if device.type == "cpu":
        return read_only_tensor(cache.array)
    out = torch.empty(cache.array.shape, dtype=torch.float16, device=device)
    row = max(1, cache.array[:1].nbytes)
    copy_in_chunks(cache.array, out, chunk_rows or max(1, (64 * BLOCK_BYTES) // row))
    return out


class DeviceGrids:
    """The splits' grids held on the device (`held`), and the caches they come from."""

    def __init__(self) -> None:
        self.held: dict[str, Tensor] = {}  # split -> (N, L, D) float16 on the device
        self.caches: dict[str, FeatureCache] = {}  # split -> the cache its `GridRows` read

    def serve(self, split: str, cache: FeatureCache, paths: Sequence[str | Path]) -> GridRows:
        """The split's inputs as rows of `cache` (held by the next `hold`; an older cache's
        grids of the split are let go)."""
        self.held.pop(split, None)
        self.caches[split] = cache
        return GridRows(split, cache.rows(paths))

    def release(self, splits: Iterable[str]) -> None:
        for split in splits:
            self.held.pop(split, None)

    def hold(self, device: str | torch.device, splits: Iterable[str], *,
             agree: Agree | None = None) -> None:
        """Copy the grids of `splits` (those served) onto `device`, where they are not yet.
        One `CacheError` line when they do not fit (`room_problem`). `agree` is asked twice
        (do they fit; did the copy work), so that every rank stops when one does."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" is "cuda:N" once held
            device = torch.device("cuda", torch.cuda.current_device())
        wanted = set(splits)
        todo = {s: c for s, c in self.caches.items() if s in wanted
                and (s not in self.held or self.held[s].device != device)}
        self.release(todo)
        what = " and ".join(f"the {s} split's {len(c):,}" for s, c in todo.items()) + " grids" \
            if todo else "the grids"
        problem = room_problem(sum(c.array.nbytes for c in todo.values()), device,
                               what=what) if todo else None
        if not ((problem is None) if agree is None else agree(problem is None)):
            raise CacheError(problem or f"data.features_on_device: {what} do not fit on "
                             "another process's GPU; set data.features_on_device false to "
                             "read them through the loader")
        error: Exception | None = None
        try:
            for split, cache in todo.items():
                t0 = time.perf_counter()
                self.held[split] = to_device(cache, device)
                log.info("%s grids of the %s split on %s in %.1fs", f"{len(cache):,}", split,
                         device, time.perf_counter() - t0)
        except Exception as e:  # out of memory, a damaged block: the other ranks learn of it
            error = e
        if (error is None) if agree is None else agree(error is None):
            return
        self.release(todo)
        raise error or CacheError(f"data.features_on_device: another process could not hold "
                                  f"{what} on its device; see its error")

    def gather(self, split: str, rows: Tensor, device: torch.device) -> Tensor:
        """(B,) rows of `split` -> their (B, L, D) grids on `device`."""
        grids = self.held[split]  # (N, L, D) float16
        picked = grids.index_select(0, rows.to(grids.device, non_blocking=True))
        return picked.to(device, non_blocking=True)
