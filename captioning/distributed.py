"""The DDP collectives the package shares; outside torch.distributed each leaves its input as
it is, so single-process code needs no branch of its own."""

from __future__ import annotations

import torch
from torch import Tensor


def is_distributed() -> bool:
    """Whether a default process group is set up (DDP)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


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
