"""`WandbLogger`: Lightning's W&B logger that never hangs or crashes a run over W&B itself.

* With no API key (no `WANDB_API_KEY`, no `wandb login` entry in the netrc file) an online run
  falls back to offline mode with one line saying so and how to sync later.
* With a key but no reachable server, `wandb.init` gives up after `init_timeout` seconds (30 by
  default, instead of W&B's minutes of retries), and the run goes offline the same way.
* Lightning passes `anonymous=None` to `wandb.init` whatever the user asked, and W&B answers
  every run with "The anonymous setting has no effect": it is passed only when set.

Use it by class path in a trainer config:

    logger:
      - class_path: captioning.callbacks.WandbLogger
        init_args: {project: captioning, save_dir: runs/demo, offline: true}
"""

from __future__ import annotations

import logging
import netrc
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from lightning.pytorch.loggers import WandbLogger as LightningWandbLogger

log = logging.getLogger(__name__)

#: Seconds `wandb.init` may take to reach the server before the run goes offline.
INIT_TIMEOUT_S = 30.0
OFFLINE_MODES = frozenset({"offline", "dryrun", "disabled"})


def has_api_key() -> bool:
    """Whether W&B has credentials: `WANDB_API_KEY`, or a netrc entry for its server."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or ""
    path = Path(os.environ.get("NETRC", Path.home() / ".netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


class WandbLogger(LightningWandbLogger):
    """`lightning.pytorch.loggers.WandbLogger` with the same arguments, plus `init_timeout`."""

    def __init__(self, *args: Any, init_timeout: float = INIT_TIMEOUT_S, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if init_timeout <= 0:
            raise ValueError(f"init_timeout must be > 0, got {init_timeout}")
        if self._wandb_init.get("anonymous") is None:
            self._wandb_init.pop("anonymous", None)
        self.init_timeout = init_timeout
        if self._offline or os.environ.get("WANDB_MODE", "").lower() in OFFLINE_MODES:
            return
        if not has_api_key():
            self._go_offline("no W&B API key (WANDB_API_KEY or `wandb login`)")
            return
        import wandb

        self._wandb_init.setdefault("settings", wandb.Settings(init_timeout=init_timeout))

    def _go_offline(self, why: str, *, session_started: bool = False) -> None:
        # Once a W&B session has started it ignores WANDB_MODE (which Lightning sets for offline
        # loggers): the mode goes to wandb.init itself.
        self._offline = self._offline or not session_started
        self._wandb_init["mode"] = "offline"
        where = self._save_dir or "."
        log.warning("%s: logging to W&B offline under %s; upload later with "
                    "`wandb sync %s/wandb/offline-run-*`", why, where, where)

    @property
    def experiment(self) -> Any:
        if self._experiment is not None or self._wandb_init.get("mode") == "offline":
            return super().experiment
        from wandb.errors import CommError, Error, UsageError

        try:
            return super().experiment
        except (CommError, UsageError, Error, TimeoutError, OSError) as e:
            reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
            self._go_offline(f"W&B server unreachable or refused ({reason})",
                             session_started=True)
            self._wandb_init.pop("settings", None)
            return super().experiment
