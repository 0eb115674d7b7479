"""Which code a result came from: a digest of the package's own source files, so that a result
kept for reuse (an ablation cell) is known to come from the code that runs now."""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

#: The package's source files: Python and the native kernels' C++.
SOURCE_SUFFIXES = (".py", ".cpp", ".h", ".cu")


def source_digest(root: Path) -> str:
    """12 hex digits of a SHA-256 over the source files under `root` (`SOURCE_SUFFIXES`; their
    paths under `root` and their bytes)."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts and p.is_file():
            h.update(p.relative_to(root).as_posix().encode() + b"\0")
            h.update(p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


@functools.cache
def code_digest() -> str:
    """`source_digest` of this package, once a process: any edit to its code changes it;
    configs and other files do not."""
    return source_digest(Path(__file__).resolve().parent)
