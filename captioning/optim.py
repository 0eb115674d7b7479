"""The optimiser step: Adam and its learning-rate schedule, and the guard that stops a run on
a non-finite loss or gradient before the weights change, with at most one host sync a step."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from captioning.distributed import all_reduce, is_distributed, world_size


def build_adam(groups: list[dict[str, Any]], *, weight_decay: float, fused: bool,
               schedule: str, warmup_steps: int, total_steps: int) -> Any:
    """Adam over `groups`, with linear warm-up over `warmup_steps`, then `constant` or
    `cosine` decay to zero at `total_steps`; Lightning's `configure_optimizers` value."""
    opt = torch.optim.Adam(groups, weight_decay=weight_decay, fused=fused or None)
    if schedule == "constant" and warmup_steps <= 0:
        return opt
    warm, total = max(0, warmup_steps), max(1, total_steps)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        if schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warm) / max(1, total - warm))
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


@dataclass
class _Pending:
    """A step's finiteness flag on its way to the host, and what its message needs."""

    ok: Tensor  # (1,) bool, on the host (pinned, from a GPU)
    ready: torch.cuda.Event | None  # recorded after the copy (None: a CPU step)
    losses: list[tuple[Tensor, Any]]
    params: list[nn.Parameter]
    norms: Tensor  # (P,) the gradients' norms, on the device
    step: int


class StepGuard:
    """Keeps each micro-batch's loss without reading it, then, before the optimiser step,
    checks those losses and the gradients' total norm together. The norm is the one that
    clipping by norm uses, so it is computed once.

    Under DDP every process decides alike: the flag is the minimum over the ranks (one
    one-element all-reduce, queued like the gradients' own), so a loss that is bad on one rank
    stops them all at the same step instead of leaving the others waiting in a collective.

    The check costs one host sync a step. With an optimiser that skips its update on a
    device flag (fused Adam's `found_inf`, as GradScaler uses it) it costs none: the flag
    skips a bad update on the device and reaches the host in the background, and the error
    is raised at the next check or `flush` (call it before validation and before a
    checkpoint is written), with the weights as they were before the bad step.
    """

    def __init__(self, named_parameters: Callable[[], Iterable[tuple[str, nn.Parameter]]]
                 ) -> None:
        self._names = named_parameters  # for the message: which parameter went bad
        self._losses: list[tuple[Tensor, Any]] = []
        self._pending: _Pending | None = None
        self._fused = False  # the step's optimiser is fused Adam, its loss not scaled
        self.grad_norm: Tensor | None = None

    def add_loss(self, loss: Tensor, batch: Any, batch_idx: int, *, step: int, epoch: int,
                 what: str | None = None) -> None:
        """Record a micro-batch's loss, and where it came from for the message if it is bad
        (`what` went bad, when not the loss itself)."""
        self._losses.append((loss.detach(), (batch, batch_idx, step, epoch, what)))

    def check(self, optimizer: torch.optim.Optimizer, *, step: int, scaled: bool = False
              ) -> None:
        """Raise FloatingPointError when a recorded loss or a gradient of the optimiser's
        parameters is NaN or infinite, on this rank or (under DDP) another one; for a deferred
        check, the previous step's, whose update was skipped. `scaled`: a GradScaler (16-mixed)
        owns the gradients' finiteness (an overflow skips the step and lowers the scale), so
        only the losses are checked."""
        self.flush()
        losses, self._losses = self._losses, []
        params = [p for group in optimizer.param_groups for p in group["params"]
                  if p.grad is not None]
        grads = [p.grad for p in params]
        # The groups say how Adam steps (a resumed checkpoint's groups win over the defaults);
        # under a GradScaler the scaler hands a fused step its own flag.
        deferred = not scaled and bool(grads) and all(g.get("fused")
                                                      for g in optimizer.param_groups)
        if not deferred and hasattr(optimizer, "found_inf"):
            del optimizer.found_inf  # only a fused step takes the flag
        if not scaled and hasattr(optimizer, "grad_scale"):
            del optimizer.grad_scale  # the previous step's clipping (`clip`)
        self._fused = deferred
        norms = _norms(grads) if grads else None  # (P,), kept to name a bad parameter
        self.grad_norm = None if norms is None else torch.linalg.vector_norm(norms)
        flags = [torch.isfinite(loss) for loss, _ in losses]
        if self.grad_norm is not None and not scaled:
            flags.append(torch.isfinite(self.grad_norm))
        if not flags:
            return
        ok = torch.stack(flags).all()
        if is_distributed():  # every DDP rank decides alike: the flag's minimum over the ranks
            ok = all_reduce(ok.to(torch.int32).view(1), "min")[0].bool()
        if deferred:  # fused Adam skips the update where found_inf != 0
            optimizer.found_inf = (~ok).float()  # type: ignore[attr-defined]
            host, ready = ok.view(1), None
            if ok.is_cuda:
                host = torch.empty(1, dtype=torch.bool, pin_memory=True)
                host.copy_(ok.view(1), non_blocking=True)
                ready = torch.cuda.Event()
                ready.record()
            self._pending = _Pending(host, ready, losses, params, norms, step)
        elif not bool(ok):  # the step's one sync
            finite = [] if norms is None else torch.isfinite(norms).tolist()
            self._raise(losses, params, finite, step)

    def flush(self) -> None:
        """Raise for a deferred check's bad step; waits for its flag if it is not there yet."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        if pending.ready is not None:
            pending.ready.synchronize()  # long done by the next step: no real wait
        if not bool(pending.ok):
            finite = torch.isfinite(pending.norms).tolist()
            self._raise(pending.losses, pending.params, finite, pending.step)

    def clip(self, optimizer: torch.optim.Optimizer, value: float | None,
             algorithm: str = "norm", *, scaled: bool = False) -> None:
        """Lightning's gradient clipping of the optimiser's parameters, done here: by norm
        with the norm `check` computed (as `torch.nn.utils.clip_grad_norm_`), or by value.
        Lightning's own refuses any fused optimiser under mixed precision; here only one that
        a GradScaler leaves scaled (`scaled`), whose gradients are not yet the true ones."""
        if not value:
            return
        if scaled and getattr(optimizer, "_step_supports_amp_scaling", False):
            raise RuntimeError("gradient clipping with a fused optimiser under 16-mixed would "
                               "clip scaled gradients: set model.fused_adam: false, or use "
                               "bf16-mixed")
        params = [p for group in optimizer.param_groups for p in group["params"]]
        if algorithm == "value":
            nn.utils.clip_grad_value_(params, value)
        elif self.grad_norm is not None:
            # On the CPU the coefficient is read at no cost (no device to wait for): within the
            # bound it is clamped to 1, and the pass multiplying every gradient by it is skipped
            if self.grad_norm.device.type == "cpu" and bool(value / (self.grad_norm + 1e-6) >= 1):
                return
            if self._fused:
                # Fused Adam divides each gradient by `grad_scale` as its update reads it (and
                # stores the result as the gradient): the coefficient's inverse clips in that
                # pass, not in one of its own over every gradient (1.2 ms a CPU training step;
                # docs/benchmarks.md, part 24). Equal to clip_grad_norm_'s to float32 rounding.
                scale = ((self.grad_norm + 1e-6) / value).clamp(min=1.0)
                optimizer.grad_scale = scale  # type: ignore[attr-defined]
                return
            nn.utils.clip_grads_with_norm_(params, value, self.grad_norm)

    def _raise(self, losses: list[tuple[Tensor, Any]], params: list[nn.Parameter],
               finite: list[bool], step: int) -> None:
        for loss, (batch, batch_idx, at, epoch, what) in losses:
            if not torch.isfinite(loss):
                raise FloatingPointError(batch_message(what or f"training loss {loss.item()}",
                                                       batch, batch_idx, step=at, epoch=epoch))
        names = {id(p): n for n, p in self._names()}
        first = next((names.get(id(p), "?") for p, ok in zip(params, finite) if not ok), None)
        if first is None and world_size() > 1:  # this rank's values are finite
            raise FloatingPointError(
                f"a non-finite training loss or gradient on another process at global step "
                f"{step}; stopping every process before the optimiser corrupts the weights")
        where = f"first in {first}" if first else "each finite, their total overflowed"
        raise FloatingPointError(
            f"non-finite gradient norm at global step {step} ({where}); stopping "
            "before the optimiser corrupts the weights")


def poisoned_loss(params: Iterable[nn.Parameter]) -> Tensor:
    """A NaN loss that reaches every trainable parameter. A DDP rank whose forward pass failed
    returns it: its backward joins the others' gradient all-reduce, and the guard's agreed
    flag then stops every rank at this step, none left waiting in a collective."""
    return sum(p.sum() for p in params if p.requires_grad) * float("nan")  # type: ignore[return-value]


def _norms(grads: list[Tensor]) -> Tensor:
    """Each gradient's L2 norm (P,), equal to those `torch.nn.utils.get_total_norm` reduces
    (one foreach kernel on CUDA; a norm per tensor on the CPU, equal to the bit), so that their
    norm is its total and clipping equals `clip_grad_norm_`'s."""
    if grads[0].is_cuda:
        return torch.stack(torch._foreach_norm(grads))
    return torch.stack([torch.linalg.vector_norm(g) for g in grads])


#: NaN or inf named in an error's message as a word: torch.multinomial's "probability tensor
#: contains either `inf`, `nan` or element < 0", "NaNs", "infinity", "non-finite"; not
#: "Inference tensors ..." or "info".
NON_FINITE_WORDS = re.compile(r"\b(nan|inf|infinite|infinity|non-finite)s?\b", re.IGNORECASE)


def says_non_finite(error: BaseException) -> bool:
    """Whether an error is a forward pass meeting NaN or inf (a reason to stop as for a
    non-finite loss), not some other fault to raise as it is."""
    return NON_FINITE_WORDS.search(str(error)) is not None


def batch_message(what: str, batch: Any, batch_idx: int, *, step: int, epoch: int) -> str:
    """The message for a non-finite value: the step, and the images whose inputs are bad."""
    msg = (f"non-finite {what} at global step {step} (epoch {epoch}, batch {batch_idx}); "
           "stopping before the weights are updated")
    images = getattr(batch, "images", None)
    if isinstance(images, Tensor) and images.is_floating_point():
        bad = (~torch.isfinite(images.flatten(1))).any(1).nonzero().flatten().tolist()
        ids = getattr(batch, "image_ids", None) or range(len(images))
        msg += f"; non-finite inputs for image(s) {[ids[i] for i in bad[:5]]}" if bad else ""
    return msg
