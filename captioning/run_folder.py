"""A run folder's layout (`trainer.default_root_dir`): torch-free, for the commands that read
configs before any model is built; and how a new run sets an earlier run's files aside."""

from __future__ import annotations

import glob
import re
from collections.abc import Iterable
from pathlib import Path

#: The checkpoint folder inside a run folder: where `LatestCheckpoint`, `CheckpointOnInterrupt`,
#: `--ckpt_path RUN` and the shipped trainer configs put the checkpoints.
RUN_CHECKPOINTS = "checkpoints"


def aside_path(path: Path, n: int, ext: str = "") -> Path:
    """The `n`-th set-aside name of `path` (named NAME + `ext`): `NAME.previous` + ext, then
    `NAME.previous-2` + ext, ..."""
    base = path.name.removesuffix(ext)
    return path.with_name(f"{base}.previous{'' if n == 1 else f'-{n}'}{ext}")


def next_aside(paths: Iterable[Path], ext: str = "") -> int:
    """One past the highest set-aside number (`aside_path`) that any of `paths` has taken: files
    set aside together keep one number, and the higher is the later, whatever was deleted."""
    taken = [0]
    for p in paths:
        base = p.name.removesuffix(ext)
        pattern = rf"{re.escape(base)}\.previous(?:-(\d+))?{re.escape(ext)}"
        for f in p.parent.glob(f"{glob.escape(base)}.previous*{glob.escape(ext)}"):
            if found := re.fullmatch(pattern, f.name):
                taken.append(int(found[1] or 1))
    return max(taken) + 1


def set_aside_checkpoints(folder: str | Path) -> Path | None:
    """Rename a checkpoint folder that holds checkpoints (`*.ckpt`) to `NAME.previous`, or where
    earlier ones were set aside, `NAME.previous-2`, `-3`, ... (one past the highest number
    taken, so the higher, the later): a fresh `fit` in a used run folder then starts with an
    empty folder and overwrites nothing. Returns the new path, or None when nothing moved."""
    folder = Path(folder)
    if not folder.is_dir() or not any(folder.glob("*.ckpt")):
        return None
    return folder.replace(aside_path(folder, next_aside([folder])))
