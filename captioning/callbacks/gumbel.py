"""The temperature τ of straight-through Gumbel-softmax hard attention, set every training step.

`CaptioningModule.configure_callbacks` attaches `GumbelTemperature` to every run; it acts only
on decoders trained with `hard_estimator: gumbel`. Before each training batch it sets the
decoder's τ (`decoder.set_tau`) from its `GumbelSchedule` at the trainer's global step (optimiser
steps, so a resumed run continues the schedule where it stopped) and logs it as
`train/gumbel_tau`.
"""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as L

log = logging.getLogger(__name__)


class GumbelTemperature(L.Callback):
    """Sets and logs τ of the Gumbel-softmax relaxation from the trainer step."""

    def __init__(self) -> None:
        self._warned = False

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        decoder: Any = getattr(getattr(pl_module, "captioner", None), "decoder", None)
        if getattr(decoder, "hard_estimator", None) != "gumbel" or decoder.attention_kind != "hard":
            return
        tau = decoder.gumbel_schedule.tau(trainer.global_step, self._total_steps(trainer))
        decoder.set_tau(tau)
        pl_module.log("train/gumbel_tau", tau, on_step=True, on_epoch=False, batch_size=1)

    def _total_steps(self, trainer: L.Trainer) -> int:
        """The run's optimiser steps (0 when unbounded: τ then stays at its start)."""
        total = trainer.estimated_stepping_batches
        if math.isfinite(total):
            return int(total)
        if not self._warned:
            log.warning("the run has no step or epoch limit: the Gumbel-softmax temperature "
                        "stays at its start; set model.net.gumbel_anneal_steps to anneal it")
            self._warned = True
        return 0
