"""Exclusive work on a shared target: a file lock, and SIGTERM as an exception meanwhile.

`exclusive_lock(target)` takes an exclusive `fcntl.flock` on `<target>.lock` beside `target`
(a shapes dataset folder, a feature cache file): a second process that wants the same target
waits (after a second it logs "waiting for ... (held by pid N)"), then re-checks and uses the
finished result. The lock is released when the block ends, and by the kernel when its holder
dies (even by `kill -9`), so a crashed holder never blocks the next run. The holder removes the
lock file on release; a waiter that then wins a lock on the removed file notices and retries.

`flock` locks work across processes on one machine and on most shared file systems (NFSv4,
Lustre and GPFS mounted with locking, CephFS). Where a file system does not support them,
`flock` fails with `ENOLCK` or `EOPNOTSUPP` and `exclusive_lock` logs a warning and goes on
unlocked: then do not start two runs on the same fresh target at once (run
`captioning shapes` / `captioning cache-features` once before starting the others), or put the
data and its caches on a local disk.

`sigterm_raises()` turns SIGTERM into a `Terminated` exception for the length of a block (in
the main thread), so that the block's `except BaseException`/`finally` clean-up runs, as it
does for Ctrl-C; the `captioning` command then reports it in one line and exits with 143.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

log = logging.getLogger(__name__)

#: Seconds a waiter polls quietly before it logs who holds the lock.
QUIET_WAIT = 1.0
_UNSUPPORTED = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL}


def lock_path(target: str | os.PathLike[str]) -> Path:
    """The lock file of `target`: `<target>.lock` beside it."""
    target = Path(target)
    return target.with_name(f"{target.name}.lock")


def _holder(path: Path) -> str:
    try:
        return path.read_text().strip() or "?"
    except OSError:
        return "?"


def _acquire(fd: int, path: Path, what: str) -> bool:
    """Take the exclusive lock on `fd`; False when the file system has no locks."""
    start = time.monotonic()
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            pass
        except OSError as e:
            if e.errno not in _UNSUPPORTED:
                raise
            log.warning("%s: file locks are not supported here (%s); going on without one",
                        path, os.strerror(e.errno))
            return False
        if time.monotonic() - start >= QUIET_WAIT:
            log.info("waiting for %s (held by pid %s)", what, _holder(path))
            fcntl.flock(fd, fcntl.LOCK_EX)  # blocking; a signal handler may still raise
            return True
        time.sleep(0.05)


def _same_file(fd: int, path: Path) -> bool:
    try:
        st = os.stat(path)
        own = os.fstat(fd)
    except FileNotFoundError:
        return False
    except OSError as e:  # NFS: this file was removed (and maybe replaced) meanwhile
        if e.errno == errno.ESTALE:
            return False
        raise
    return (st.st_dev, st.st_ino) == (own.st_dev, own.st_ino)


def _open(path: Path) -> int:
    """The lock file, created with the umask's permissions; read-only when another user's
    (flock needs no write access)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY)


@contextlib.contextmanager
def exclusive_lock(target: str | os.PathLike[str], *, what: str | None = None
                   ) -> Iterator[bool]:
    """Hold an exclusive lock on `target` (through `<target>.lock`) for the block; blocks while
    another process holds it. `what` names the target in the waiting message. Yields whether
    the lock is held: False where the file system has no locks (a warning was logged)."""
    path = lock_path(target)
    what = what or str(target)
    while True:
        fd = _open(path)
        try:
            locked = _acquire(fd, path, what)
        except BaseException as e:
            os.close(fd)
            if isinstance(e, OSError) and e.errno == errno.ESTALE:
                continue  # NFS: the holder removed the file this process waited on
            raise
        if not locked or _same_file(fd, path):
            break
        os.close(fd)  # the previous holder removed this file: lock the new one
    try:
        if locked:
            with contextlib.suppress(OSError):  # read-only: another user's lock file
                os.ftruncate(fd, 0)
                os.write(fd, f"{os.getpid()}\n".encode())
        yield locked
    finally:
        if locked:
            with contextlib.suppress(OSError):
                path.unlink()  # still ours: removed before the lock is released
        os.close(fd)


class FolderInUseError(FileExistsError):
    """Another process is running in the folder a run was given."""


@contextlib.contextmanager
def claim_folder(folder: str | os.PathLike[str], *, what: str = "run folder",
                 beside: bool = False) -> Iterator[Path]:
    """Hold `folder` for one run (through `<folder>/.lock`, or with `beside` `<folder>.lock`,
    which stays when the folder is renamed), without waiting: when another process holds it,
    raise `FolderInUseError` naming the folder and that process."""
    folder = Path(folder)
    (folder.parent if beside else folder).mkdir(parents=True, exist_ok=True)
    path = lock_path(folder) if beside else folder / ".lock"
    fd = _open(path)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise FolderInUseError(f"{folder}: {what} in use by another run (pid {_holder(path)}); "
                               "give this run its own folder") from None
    except OSError as e:
        if e.errno not in _UNSUPPORTED:
            os.close(fd)
            raise
        log.warning("%s: file locks are not supported here; not guarding the %s", path, what)
    try:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        yield folder
    finally:
        os.close(fd)  # the file stays: removing it could let a third run lock a new one


def lock_held(target: str | os.PathLike[str]) -> bool:
    """Whether a process holds `target`'s lock right now."""
    try:
        fd = os.open(lock_path(target), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)  # also releases the lock just taken
    return False


class Terminated(BaseException):
    """SIGTERM arrived inside `sigterm_raises()`. Like `KeyboardInterrupt`, not an
    `Exception`, so that no `except Exception` swallows it."""

    interrupt = "SIGTERM"  # what `captioning.commands.errors.interrupted` reports


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """SIGTERM raises `Terminated` in the main thread during the block, after calling any
    Python handler installed before (Lightning's); that handler is restored afterwards.
    A forked child (a DataLoader worker) dies of SIGTERM as usual. A no-op outside the main
    thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    owner = os.getpid()

    def handler(signum: int, frame: FrameType | None) -> Any:
        if os.getpid() != owner:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGTERM)
            return
        if callable(previous):
            previous(signum, frame)
        raise Terminated("interrupted by SIGTERM")

    signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def die_with_parent() -> Callable[[], None] | None:
    """A `Popen(preexec_fn=...)` by which the child receives SIGTERM when this process dies,
    even by SIGKILL, so that no orphan runs on in a folder the next run takes; a parent gone
    before that took hold ends the child at once. None off Linux. (`prctl` is looked up here,
    in the parent: loading a library in a forked child can hang.)"""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
        if os.getppid() != parent:
            os._exit(1)

    return preexec
