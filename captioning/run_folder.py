"""A run folder's layout (`trainer.default_root_dir`): torch-free, for the commands that read
configs before any model is built; and how a new run keeps an earlier run's checkpoints."""

from __future__ import annotations

import re
from pathlib import Path

#: The checkpoint folder inside a run folder: where `LatestCheckpoint`, `CheckpointOnInterrupt`,
#: `--ckpt_path RUN` and the shipped trainer configs put the checkpoints.
RUN_CHECKPOINTS = "checkpoints"


def set_aside_checkpoints(folder: str | Path) -> Path | None:
    """Rename a checkpoint folder that holds checkpoints (`*.ckpt`) to `NAME.previous`, or where
    earlier ones were set aside, `NAME.previous-2`, `-3`, ... (one past the highest number
    taken, so the higher, the later): a fresh `fit` in a used run folder then starts with an
    empty folder and overwrites nothing. Returns the new path, or None when nothing moved."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("*.ckpt")):
        return None
    taken = [0]
    for f in folder.parent.glob(f"{folder.name}.previous*"):
        found = re.fullmatch(rf"{re.escape(folder.name)}\.previous(?:-(\d+))?", f.name)
        if found:
            taken.append(int(found[1] or 1))
    n = max(taken) + 1
    return folder.replace(folder.with_name(
        f"{folder.name}.previous" if n == 1 else f"{folder.name}.previous-{n}"))
