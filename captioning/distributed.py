"""The DDP collectives the package shares; outside torch.distributed each leaves its input as
it is, so single-process code needs no branch of its own. (What a launcher tells a process
before torch.distributed is set up: `captioning.launch`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor


def is_distributed() -> bool:
    """Whether a default process group is set up (DDP)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def agreement(strategy: Any) -> Callable[[bool], bool] | None:
    """Every rank's verdict, all or none, under a Lightning strategy of several processes
    (`reduce_boolean_decision`); None for one process."""
    if strategy is None or getattr(strategy, "world_size", 1) < 2:
        return None
    return strategy.reduce_boolean_decision


def world_size() -> int:
    return torch.distributed.get_world_size() if is_distributed() else 1


def all_reduce(t: Tensor, op: str = "sum") -> Tensor:
    """`t` reduced over the ranks by `op` ("sum", "min" or "max"), as a copy; `t` itself
    outside torch.distributed."""
    if not is_distributed():
        return t
    out = t.clone()
    torch.distributed.all_reduce(out, op=getattr(torch.distributed.ReduceOp, op.upper()))
    return out


def all_gather_objects(obj: Any) -> list[Any]:
    """Every rank's `obj` (picklable), in rank order; `[obj]` outside torch.distributed."""
    if not is_distributed():
        return [obj]
    parts: list[Any] = [None] * world_size()
    torch.distributed.all_gather_object(parts, obj)
    return parts


def broadcast_object(obj: Any, *, src: int = 0) -> Any:
    """Rank `src`'s `obj` (picklable), on every rank; `obj` outside torch.distributed."""
    if not is_distributed():
        return obj
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


class RankZeroFailed(RuntimeError):
    """Rank zero's error line, on a rank that waited for it (`rank_zero_first`)."""


def rank_zero_first(strategy: Any, fn: Callable[[], None], *, what: str) -> None:
    """`fn` on rank zero, then on the other ranks of a Lightning `strategy`, which wait for
    rank zero's outcome (a broadcast): where rank zero raises, it raises there once the others
    are told, and they raise `RankZeroFailed` with its line, where a bare barrier would hold
    them until the collective's timeout. `what` names the work in that line."""
    failure: Exception | None = None
    outcome: str | None = None
    if strategy.is_global_zero:
        try:
            fn()
        except Exception as e:  # raised again below, once the other ranks are told
            failure, outcome = e, f"{type(e).__name__}: {e}"
    outcome = strategy.broadcast(outcome, src=0)
    if failure is not None:
        raise failure
    if outcome is not None:
        raise RankZeroFailed(f"rank zero could not {what}, so this rank stops: {outcome}")
    if not strategy.is_global_zero:
        fn()


def end_process_group(*, barrier: bool = True) -> None:
    """Tear the default process group down, after a last `barrier` (skipped on an error path,
    where another rank may never reach it), so that no gloo/NCCL thread or TCP store is still
    running when the interpreter exits (an abort at exit otherwise: "terminate called without
    an active exception")."""
    if not is_distributed():
        return
    if barrier:
        torch.distributed.barrier()
    torch.distributed.destroy_process_group()
