"""`WandbLogger`: Lightning's W&B logger, minus the settings W&B no longer reads.

Lightning passes `anonymous=None` to `wandb.init` whatever the user asked, and W&B >= 0.19
answers every run with "The anonymous setting has no effect" -- a warning about the wiring,
not about the user's run. Use it by class path in a trainer config:

    logger:
      - class_path: captioning.callbacks.WandbLogger
        init_args: {project: captioning, save_dir: runs/demo, offline: true}
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger


class WandbLogger(LightningWandbLogger):
    """`lightning.pytorch.loggers.WandbLogger` with the same arguments; `anonymous` is passed
    to W&B only when set."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
