"""User errors and interruptions: one `error: ...` line on stderr and an exit status.

Failures a user can cause (bad arguments or config values, bad data, a missing or unsafe
checkpoint, a non-finite loss) end with one line and exit status 2 (arguments, config) or 1
(everything else), not a traceback; anything else is a bug and keeps its traceback. An
interrupted command exits with 130 (Ctrl-C) or 143 (SIGTERM) after saying where its checkpoint
went (see `captioning.callbacks.CheckpointOnInterrupt`).
"""

from __future__ import annotations

import argparse
import errno
import logging
import re
import sys

from captioning.locks import Terminated

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A bad value on the command line or in a config file."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that report a user's mistake, not a bug: shown as one line, no traceback."""
    from captioning.checkpoint import CheckpointError
    from captioning.data.features import CacheError
    from captioning.data.images import ImageLoadError
    from captioning.data.problems import DataError
    from captioning.distributed import RankZeroFailed  # rank zero reports its own error

    return (ConfigError, DataError, ImageLoadError, FloatingPointError, FileNotFoundError,
            FileExistsError, PermissionError, NotADirectoryError, IsADirectoryError,
            CheckpointError, CacheError, RankZeroFailed)


#: Errors of the disk or file system (not of the program): a full disk or quota, a file-size
#: limit, a read-only file system, too many open files.
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EROFS, errno.EMFILE,
                         errno.EIO})


def disk_error(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def _type_name(text: str) -> str:
    text = text.strip()
    found = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", text)
    if found:
        return "null" if found.group(1) == "NoneType" else found.group(1)
    found = re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", text)
    if found:
        return f"one of {found.group(1)}"
    return text


def parser_error_line(message: str) -> str:
    """jsonargparse's multi-line error, in one line: `--key: invalid value 'x' (expected ...)`."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    if not lines:
        return "invalid arguments"
    head = re.match(r'^Parser key "([^"]+)":\s*(.*)$', lines[0])
    if head is None:
        return " ".join(lines)
    key, rest = head.groups()
    body = [rest, *lines[1:]] if rest else lines[1:]
    value = expected = None
    types: list[str] = []
    for ln in body:
        found = re.search(r"(?:Given|Got) value:\s*(.*)$", ln)
        if found:
            value = found.group(1)
        found = re.match(r"^(?:- )?Expected an? (.+?)(?:\. Got value:.*)?$", ln)
        if found:
            types.append(_type_name(found.group(1)))
    if types:
        expected = " or ".join(dict.fromkeys(types))
    if value is not None:
        return f"--{key}: invalid value {value!r}" + (f" (expected {expected})" if expected else "")
    return f"--{key}: " + " ".join(body)


def error(message: str) -> None:
    """Write one `error: ...` line to stderr."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()


def interrupted(exc: BaseException) -> int:
    """Report an interrupted command; returns the exit status (130 Ctrl-C, 143 SIGTERM)."""
    cause = getattr(exc, "interrupt", None) or (
        "KeyboardInterrupt" if isinstance(exc, KeyboardInterrupt) else "SIGTERM")
    path = getattr(exc, "checkpoint_path", None)
    what = "SIGTERM" if cause == "SIGTERM" else "Ctrl-C"
    if path:
        msg = f"interrupted by {what}; saved {path} (resume with --ckpt_path last)"
    else:
        msg = f"interrupted by {what}"
    sys.stderr.write(msg + "\n")
    return 143 if cause == "SIGTERM" else 130


def exit_status(exc: BaseException) -> int | None:
    """Report `exc` if it is a user error or an interruption; None for everything else."""
    if isinstance(exc, argparse.ArgumentError):
        error(parser_error_line(str(exc)))
        return 2
    exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")
    sigterm = getattr(exceptions, "SIGTERMException", None)
    if sigterm is not None and isinstance(exc, sigterm):
        return interrupted(exc)
    if isinstance(exc, SystemExit):
        # Lightning turns a KeyboardInterrupt during fit into sys.exit(1)
        if exc.code == 1 and isinstance(exc.__context__, KeyboardInterrupt):
            return interrupted(exc.__context__)
        return None
    if isinstance(exc, (KeyboardInterrupt, Terminated)):  # Terminated: SIGTERM, see locks
        return interrupted(exc)
    from captioning.distributed import RankZeroFailed

    if isinstance(exc, RankZeroFailed) and exc.interrupt:  # rank zero was interrupted
        return interrupted(exc)
    if isinstance(exc, user_error_types()) or disk_error(exc):
        log.debug("user error", exc_info=exc)
        error(str(exc).strip() or type(exc).__name__)
        return 2 if isinstance(exc, ConfigError) else 1
    return None
