"""The DDP collectives the package shares; outside torch.distributed each leaves its input as
it is, so single-process code needs no branch of its own. (What a launcher tells a process
before torch.distributed is set up: `captioning.launch`.)"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

T = TypeVar("T")


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


class RankZeroFailed(RuntimeError):
    """Rank zero's error line, on a rank that waited for it (`rank_zero_result`). `interrupt`:
    what stopped rank zero where an interruption did (its exception's `interrupt`, as SIGTERM's
    `Terminated` has, or "KeyboardInterrupt"), else None."""

    def __init__(self, message: str, interrupt: str | None = None) -> None:
        super().__init__(message)
        self.interrupt = interrupt


def rank_zero_result(strategy: Any, fn: Callable[[], T], *, what: str) -> T:
    """`fn()` run on rank zero of a Lightning `strategy` alone, its result on every rank (a
    broadcast). Where rank zero raises (SIGTERM's `Terminated` included), it raises there once
    the others are told, and they raise `RankZeroFailed` with its line, where a bare wait would
    hold them until the collective's timeout. `what` names the work in that line."""
    failure: BaseException | None = None
    sent: tuple[Any, str | None, str | None] = (None, None, None)  # result, error, interrupt
    if strategy.is_global_zero:
        try:
            sent = (fn(), None, None)
        except BaseException as e:  # raised again below, once the other ranks are told
            interrupt = "KeyboardInterrupt" if isinstance(e, KeyboardInterrupt) else None
            failure, sent = e, (None, f"{type(e).__name__}: {e}",
                                getattr(e, "interrupt", None) or interrupt)
    try:
        result, outcome, interrupt = strategy.broadcast(sent, src=0)
    except BaseException:
        if failure is not None:  # rank zero's own error first
            raise failure from None
        raise
    if failure is not None:
        raise failure
    if outcome is not None:
        raise RankZeroFailed(f"rank zero could not {what}, so this rank stops: {outcome}",
                             interrupt)
    return result


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
