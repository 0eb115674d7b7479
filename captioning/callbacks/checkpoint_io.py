"""`AtomicCheckpointIO`: Lightning writes every checkpoint through the project's atomic writer.

Lightning's own save writes a temporary file where `tempfile` puts it (often `$TMPDIR`, on
another file system than the run folder) and then copies it over the checkpoint, emptying the
old file first: a full disk or a `kill -9` during that copy left `last.ckpt` at 0 bytes. Here the
checkpoint goes to a temporary file beside its target (PID in its name), is fsynced and renamed
over the old one (`captioning.atomic.write_atomic`): a failed or killed save leaves the previous
checkpoint intact and no partial file under a checkpoint name. The temporary files of writers
that died are removed the first time a process saves into that folder (and by
`LatestCheckpoint` when training starts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import resource
import shutil
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.plugins.io import TorchCheckpointIO

from captioning.atomic import remove_stale_temporaries, write_atomic
from captioning.checkpoint import CheckpointError

log = logging.getLogger(__name__)


class AtomicCheckpointIO(TorchCheckpointIO):
    """`TorchCheckpointIO` whose saves are atomic (local paths; URLs keep Lightning's save).

    A save that fails (a full disk, a file-size limit) raises `CheckpointError` naming the file
    and saying that the previous checkpoint is intact.
    """

    def __init__(self) -> None:
        super().__init__()
        self._cleaned: set[Path] = set()  # folders whose stale temporary files were removed

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any = None) -> None:
        if storage_options is not None or "://" in str(path):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.parent not in self._cleaned:
            remove_stale_temporaries(target.parent)
            self._cleaned.add(target.parent)
        try:
            write_atomic(target, lambda tmp: self.write_file(checkpoint, tmp))
        except (OSError, RuntimeError) as e:  # torch reports a failed write as RuntimeError
            raise CheckpointError(f"{target}: could not save the checkpoint ({_why(e, target)});"
                                  " the previous file, if any, is intact") from e
        log.debug("saved %s", target)

    def write_file(self, checkpoint: dict[str, Any], tmp: Path) -> None:
        """Write the checkpoint to the temporary file `tmp` (a hook for tests)."""
        torch.save(checkpoint, tmp)


def _why(error: BaseException, target: Path) -> str:
    """The error's first line, with the free space and the file-size limit where it was."""
    text = str(error).strip()
    parts = [text.splitlines()[0][:160] if text else type(error).__name__]
    with contextlib.suppress(OSError):
        parts.append(f"{shutil.disk_usage(target.parent).free / 2**20:.0f} MiB free there")
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit != resource.RLIM_INFINITY:
        parts.append(f"file-size limit {limit / 2**20:.1f} MiB")
    return "; ".join(parts)
