"""Durable file writes: the one atomic writer, and the clean-up of writers that died.

`write_atomic(target, write)` has `write` fill a temporary file beside `target` (same folder,
so the rename cannot cross file systems), flushes it to disk, then renames it over `target`:
a reader sees the old file or the new one, never a partial one, and a failed or killed write
leaves the old file intact. Temporary names carry the writer's machine and PID, so that the
next run can remove the ones whose writer is dead (`is_stale`, `remove_stale_temporaries`):
on a shared file system another machine's PID means nothing here, so another machine's
temporary counts as dead only once nobody has written to it for `STALE_ELSEWHERE_S`. Files get
the permissions the umask gives, like any file the user creates.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import secrets
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

#: `.NAME.HOST.PID.RANDOM.tmp`: the temporary file of a write to NAME by process PID on the
#: machine HOST (`HOST`; names written before it had none, and count as this machine's).
TEMP_RE = re.compile(
    r"^\.(?P<name>.+?)\.(?:(?P<host>[0-9a-f]{8})\.)?(?P<pid>\d+)\.[0-9a-f]{8}\.tmp$")
#: This machine, in temporary names: a digest of its host name.
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
#: How long another machine's temporary must go unwritten before it counts as left behind.
STALE_ELSEWHERE_S = 24 * 3600


def temporary_name(target: Path) -> Path:
    """A fresh temporary path beside `target`, carrying this machine and process."""
    return target.with_name(f".{target.name}.{HOST}.{os.getpid()}.{secrets.token_hex(4)}.tmp")


def is_stale(p: Path, *, name: str | None = None) -> bool:
    """Whether `p` is a temporary (of a write to `name`, when given) whose writer is gone: a
    PID not alive on this machine, or another machine's file untouched for a day."""
    found = TEMP_RE.match(p.name)
    if found is None or (name is not None and found["name"] != name):
        return False
    if found["host"] in (None, HOST):
        return not pid_alive(int(found["pid"]))
    try:
        return time.time() - p.stat().st_mtime > STALE_ELSEWHERE_S
    except FileNotFoundError:
        return False


def write_atomic(target: str | os.PathLike[str], write: Callable[[Path], Any]) -> Path:
    """`write(tmp)` to a temporary file beside `target`, fsync it, rename it over `target` and
    fsync the folder; the temporary file is removed when anything fails, and an OS error that
    names no file (a full disk during `write`) names `target`. Returns `target`."""
    target = Path(target)
    tmp = temporary_name(target)
    try:
        with open(tmp, "xb"):  # created with the usual permissions (the umask's)
            mode = os.stat(tmp).st_mode & 0o777
        write(tmp)
        os.chmod(tmp, mode)  # some writers (mkstemp, safetensors) make files private (0600)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise naming(target, e) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(target.parent)
    return target


def naming(path: Path, e: OSError) -> OSError:
    """`e` naming `path` where it names no file (an error raised through a file object), so
    that its one-line report says which file."""
    if e.filename is not None:
        return e
    named = OSError(e.errno, e.strerror or str(e), str(path))  # the errno's own subclass
    named.__cause__ = e
    return named


def write_text_atomic(target: str | os.PathLike[str], text: str) -> Path:
    return write_atomic(target, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def write_json_atomic(target: str | os.PathLike[str], data: Any, *, indent: int | None = 1
                      ) -> Path:
    return write_text_atomic(target, json.dumps(data, indent=indent) + "\n")


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a folder's renames durable (POSIX; a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (on this machine)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def remove_stale_temporaries(folder: str | os.PathLike[str], *, pattern: str = "*.tmp"
                             ) -> list[Path]:
    """Remove the temporary files in `folder` whose writer is gone (`is_stale`); returns them.
    Files of live writers, and names that are not temporaries, are left alone."""
    removed = []
    for p in sorted(Path(folder).glob(pattern)):
        if not is_stale(p):
            continue
        try:
            p.unlink()
        except FileNotFoundError:
            continue
        removed.append(p)
    if removed:
        log.info("removed %d temporary file(s) left by dead processes in %s", len(removed),
                 folder)
    return removed
