"""`--ckpt_path PATH|last|best|FOLDER` of `captioning fit|validate|test|predict`: every way of
naming a checkpoint becomes one file, checked by `captioning.checkpoint.check_checkpoint_file`
before Lightning opens it (exported model folders are read in `commands.lightning`).

* `last`: `last.ckpt` in the folder of the config's `LatestCheckpoint` (else of the first
  `ModelCheckpoint` that saves a last checkpoint, else of the first one; a callback without a
  `dirpath` means `default_root_dir/checkpoints`): where `CheckpointOnInterrupt` saves too.
  `fit --ckpt_path last` with no checkpoint at all starts from scratch with a warning (as
  Lightning does, so that a job script can always pass it); the other commands refuse.
* `best`: the best checkpoint that a metric-monitoring `ModelCheckpoint` recorded in its state,
  read from the newest readable checkpoint of the run.
* a folder of checkpoints: its `last.ckpt`; a run folder (`default_root_dir`):
  its `checkpoints/last.ckpt`.

An unreadable file is never replaced by another one silently: the error names the newest good
checkpoint beside it, to pass explicitly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lightning.pytorch.callbacks import ModelCheckpoint

from captioning.callbacks import LatestCheckpoint
from captioning.checkpoint import (
    CHECKPOINT_SUFFIX,
    CheckpointError,
    CheckpointNotFoundError,
    check_checkpoint_file,
    checkpoint_summary,
    older_good_checkpoint,
    read_checkpoint,
)
from captioning.commands.configs import entry_class
from captioning.commands.errors import ConfigError
from captioning.run_folder import RUN_CHECKPOINTS, set_aside_checkpoints

log = logging.getLogger(__name__)

LAST = f"{ModelCheckpoint.CHECKPOINT_NAME_LAST}{ModelCheckpoint.FILE_EXTENSION}"


@dataclass(frozen=True)
class CheckpointFolder:
    """Where a configured `ModelCheckpoint` writes, and what."""

    folder: Path
    saves_last: bool
    monitor: str | None


def checkpoint_folders(trainer: Mapping[str, Any]) -> list[CheckpointFolder]:
    """The `ModelCheckpoint` callbacks of a trainer config (LightningCLI's class_path form)."""
    root = Path(str(trainer.get("default_root_dir") or "."))
    found = []
    for cb in _as_list(trainer.get("callbacks")):
        cls = cb.__class__ if isinstance(cb, ModelCheckpoint) else entry_class(cb)
        if cls is None or not issubclass(cls, ModelCheckpoint):
            continue
        args = vars(cb) if isinstance(cb, ModelCheckpoint) else dict(cb.get("init_args") or {})
        folder = Path(str(args.get("dirpath") or root / RUN_CHECKPOINTS))
        saves_last = issubclass(cls, LatestCheckpoint) or bool(args.get("save_last"))
        found.append(CheckpointFolder(folder, saves_last, args.get("monitor")))
    return found


def resolve_ckpt_path(ckpt_path: Any, trainer: Mapping[str, Any], command: str
                      ) -> tuple[Any, dict[str, Any] | None]:
    """(the `ckpt_path` to give Lightning, the checked checkpoint's contents or None).

    `last`, `best` and folders become a file; Lightning's other special values and URLs are
    returned as they are, with None."""
    resume = command == "fit"
    text = "" if ckpt_path is None else str(ckpt_path)
    if text == "last":
        path = last_file(checkpoint_folders(trainer), trainer, command)
    elif text == "best":
        path = best_file(checkpoint_folders(trainer))
    elif text and Path(text).is_dir():
        path = folder_file(Path(text), resume=resume)
    else:
        return ckpt_path, check_checkpoint_file(ckpt_path, resume=resume)
    if path is None:
        return None, None
    return str(path), check_checkpoint_file(path, resume=resume)


def last_file(folders: Sequence[CheckpointFolder], trainer: Mapping[str, Any], command: str
              ) -> Path | None:
    """`last.ckpt` of the run; None for `fit` when the run has no checkpoint yet."""
    root = Path(str(trainer.get("default_root_dir") or "."))
    first = next((f for f in folders if f.saves_last), folders[0] if folders else None)
    folder = first.folder if first else root / RUN_CHECKPOINTS
    path = folder / LAST
    if path.exists():
        return path
    if folder.is_dir() and any(folder.glob(f"*{CHECKPOINT_SUFFIX}")):
        older = older_good_checkpoint(path, resume=command == "fit")
        hint = (f"; an older good checkpoint exists: {older[0]} ({checkpoint_summary(older[1])})"
                f"; pass `--ckpt_path {older[0]}` to use it") if older else \
            f"; the other checkpoints in {folder} are unreadable"
        raise CheckpointNotFoundError(f"--ckpt_path last: {path} does not exist{hint}")
    if command == "fit":
        log.warning("--ckpt_path last: no checkpoint in %s yet; training starts from scratch",
                    folder)
        return None
    raise CheckpointNotFoundError(f"--ckpt_path last: no checkpoint in {folder}")


def best_file(folders: Sequence[CheckpointFolder]) -> Path:
    """The best checkpoint recorded by a metric-monitoring `ModelCheckpoint`."""
    monitors = [f for f in folders if f.monitor]
    if not monitors:
        raise CheckpointError("--ckpt_path best: no ModelCheckpoint in the config monitors a "
                              "metric, so no checkpoint is the best; name a file")
    last = [f.folder / LAST for f in folders if f.saves_last]
    others = [p for f in monitors if f.folder.is_dir()
              for p in sorted(f.folder.glob(f"*{CHECKPOINT_SUFFIX}"),
                              key=lambda p: p.stat().st_mtime, reverse=True)]
    for candidate in dict.fromkeys([*last, *others]):
        best = _recorded_best(candidate, monitors)
        if best is not None:
            return best
    where = ", ".join(sorted({str(f.folder) for f in monitors}))
    raise CheckpointNotFoundError(f"--ckpt_path best: no readable checkpoint in {where} records "
                                  f"a best checkpoint for {monitors[0].monitor!r}")


def _recorded_best(candidate: Path, monitors: Sequence[CheckpointFolder]) -> Path | None:
    """The existing best checkpoint that `candidate`'s ModelCheckpoint states record."""
    if not candidate.is_file():
        return None
    try:
        states = read_checkpoint(candidate, "cpu", mmap=True).get("callbacks") or {}
    except CheckpointError:
        return None
    for state in states.values() if isinstance(states, dict) else ():
        recorded = state.get("best_model_path") if isinstance(state, dict) else None
        for f in monitors:
            if recorded and state.get("monitor") == f.monitor:
                # the file of that name in the configured folder (the run may have moved)
                for path in (f.folder / Path(recorded).name, Path(recorded)):
                    if path.is_file():
                        return path
    return None


def folder_file(folder: Path, *, resume: bool) -> Path:
    """A folder names its `last.ckpt`, or, for a run folder, `checkpoints/last.ckpt` (where the
    shipped trainer configs' checkpoint callbacks write: `default_root_dir/checkpoints`)."""
    places = [folder, folder / RUN_CHECKPOINTS]
    for place in places:
        if (place / LAST).exists():
            return place / LAST
    older = next((o for o in (older_good_checkpoint(p / LAST, resume=resume) for p in places)
                  if o is not None), None)
    hint = (f"; it holds {older[0]} ({checkpoint_summary(older[1])}): pass that file")\
        if older else ""
    looked = " nor ".join(str(p / LAST) for p in places)
    raise CheckpointNotFoundError(f"{folder}: is a folder without a checkpoint (no {looked}), "
                                  "and not an exported model (no config.json or "
                                  f"model.safetensors){hint}")


def explicit_conflicts(args: Sequence[str], config: Any, hparams: Mapping[str, Any],
                       exempt: Iterable[str]) -> list[str]:
    """`--model.KEY VALUE` flags in `args` whose value (in `config`) differs from the
    checkpoint's model `hparams` (KEY's value there), except the `exempt` keys (and those
    under them), as "--model.KEY VALUE (the checkpoint has OTHER)"."""
    exempt = tuple(exempt)
    conflicts = []
    for key in dict.fromkeys(a[2:].split("=", 1)[0] for a in args if a.startswith("--model.")):
        if any(key == k or key.startswith(f"{k}.") for k in exempt):
            continue
        found, theirs = _lookup(hparams, key.split(".")[1:])
        mine = config.get(key) if found else None
        mine = mine.as_dict() if hasattr(mine, "as_dict") else mine
        if found and mine != theirs:
            conflicts.append(f"--{key} {mine!r} (the checkpoint has {theirs!r})")
    return conflicts


def _lookup(data: Any, keys: Sequence[str]) -> tuple[bool, Any]:
    for k in keys:
        if not isinstance(data, Mapping) or k not in data:
            return False, None
        data = data[k]
    return True, data


def _as_list(value: Any) -> list[Any]:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def folders_outside(trainer: Mapping[str, Any], root: Any) -> list[Path]:
    """The checkpoint folders of a trainer config that lie neither in the run folder `root` nor
    around it or the current folder (those a new fit never sets aside)."""
    run, here = Path(str(root)).resolve(), Path.cwd()
    out = [f.folder.resolve() for f in checkpoint_folders(trainer)
           if not f.folder.parts[0].endswith(":")]  # a remote dirpath (s3://...): no lock
    return list(dict.fromkeys(f for f in out if run not in (f, *f.parents)
                              and f not in (here, *here.parents, *run.parents)))


def set_aside_earlier_checkpoints(trainer: Mapping[str, Any], init_from: Any = None) -> None:
    """A new fit (no `--ckpt_path`) in a run folder (`default_root_dir`): the checkpoints an
    earlier run left in its checkpoint folders move aside (`run_folder.set_aside_checkpoints`),
    so that none is overwritten. A folder holding the run folder or the current one is never
    moved; `init_from` inside a folder to move is refused (the run needs its own folder)."""
    if not trainer.get("default_root_dir"):
        return
    root = Path(str(trainer["default_root_dir"])).resolve()
    folders = [f.folder for f in checkpoint_folders(trainer)] + [root / RUN_CHECKPOINTS]
    start = Path(str(init_from)).resolve() if init_from else None
    for folder in dict.fromkeys(f.resolve() for f in folders):
        if folder in (root, Path.cwd()) or folder in root.parents or folder in Path.cwd().parents:
            continue
        if start is not None and folder in start.parents and any(folder.glob("*.ckpt")):
            raise ConfigError(
                f"model.init_from {init_from} lies in {folder}, which holds an earlier run's "
                "checkpoints that a new fit sets aside: give this run its own run folder "
                "(--trainer.default_root_dir DIR)")
        moved = set_aside_checkpoints(folder)
        if moved is not None:
            log.warning("a new fit (no --ckpt_path) in a used run folder: moved the earlier "
                        "run's checkpoints to %s (move it back to resume that run with "
                        "--ckpt_path last)", moved)
