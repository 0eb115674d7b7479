"""The `captioning` command: dispatch to a command module, exit statuses, the W&B run's end.

* `captioning fit|validate|test --config configs/... [--data.source.root ...]`  (LightningCLI)
* `captioning demo [--attention soft|hard]`  generate shapes, train, test, print results
* `captioning shapes --root DIR`  write the synthetic shapes dataset
* `captioning caption --checkpoint CKPT IMAGE ...`  caption images with a checkpoint
* `captioning cache-features --config ...`  build the frozen-encoder feature cache ahead of time

Each command lives in `captioning.commands`; heavy imports (torch, lightning) happen inside
them, so `--help` and `caption` start fast. User errors and interruptions end in one line
(`captioning.commands.errors`).
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Sequence

from captioning.commands.errors import exit_status

#: Commands other than LightningCLI's, by the module under `captioning.commands` that runs them.
COMMANDS = {"caption": "caption", "demo": "demo", "shapes": "shapes",
            "cache-features": "cache_features"}
NO_WANDB = frozenset({"caption", "shapes"})


def _finish_wandb(failed: bool) -> None:
    """End the W&B run a command started, so that the next command in this process (tests,
    notebooks) starts its own instead of reusing it."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


def _dispatch(argv: list[str], from_shell: bool) -> int:
    command = argv[0] if argv else ""
    if command in COMMANDS:
        module = importlib.import_module(f"captioning.commands.{COMMANDS[command]}")
        return int(module.main(argv[1:]))
    from captioning.commands.lightning import lightning_cli

    lightning_cli(None if from_shell else argv)
    return 0


def _run(argv: list[str], from_shell: bool) -> int:
    if argv and argv[0] in NO_WANDB:
        return _dispatch(argv, from_shell)
    try:
        status = _dispatch(argv, from_shell)
    except BaseException:
        _finish_wandb(failed=True)
        raise
    _finish_wandb(failed=False)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run a `captioning` command; returns its exit status."""
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(argv, from_shell)
    except BaseException as e:
        status = exit_status(e)
        if status is None:
            raise
        return status


if __name__ == "__main__":
    sys.exit(main())
