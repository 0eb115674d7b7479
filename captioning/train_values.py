"""A training step's values for the loggers, logged only on the steps Lightning hands on."""

from __future__ import annotations

import lightning.pytorch as L
from torch import Tensor


def reaches_loggers(trainer: L.Trainer | None, global_step: int) -> bool:
    """Whether Lightning hands the values of the step now running to the loggers: every
    `log_every_n_steps` optimiser steps (never at 0), and the step a run stops on."""
    if trainer is None or trainer.fast_dev_run:
        return True
    n = trainer.log_every_n_steps
    return n > 0 and ((global_step + 1) % n == 0 or trainer.should_stop)


class TrainValues:
    """Logs a training step's loss parts (`train/*`, and `train_loss` on the progress bar)
    only when they reach the loggers: a logged value costs about 1 ms of host time, much of a
    GPU step. A step that sets `should_stop` after its training step (a callback's time
    limit, early stopping) is logged at its batch end, as Lightning would have sent it."""

    def __init__(self) -> None:
        self._held: tuple[dict[str, Tensor], int] | None = None

    def offer(self, module: L.LightningModule, trainer: L.Trainer | None,
              parts: dict[str, Tensor], batch_size: int) -> None:
        """Called from `training_step` with the step's loss parts (`trainer`: None when the
        module runs outside one)."""
        self._held = ({k: v.detach() for k, v in parts.items()}, batch_size)
        if reaches_loggers(trainer, module.global_step):
            self._log(module)

    def on_batch_end(self, module: L.LightningModule) -> None:
        """Called from `on_train_batch_end`, after every callback's."""
        if self._held is not None and module.trainer.should_stop and \
                module.trainer.log_every_n_steps > 0:
            self._log(module)
        self._held = None

    def _log(self, module: L.LightningModule) -> None:
        assert self._held is not None
        parts, bs = self._held
        self._held = None
        module.log_dict({f"train/{k}": v for k, v in parts.items()}, batch_size=bs)
        module.log("train_loss", parts["loss"], batch_size=bs, prog_bar=True, logger=False)
