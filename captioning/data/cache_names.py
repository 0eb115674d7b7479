"""What a feature cache is called (`captioning.data.features`): its key, which hashes the
encoder config, the input size and every image file, and its files' names. Building a cache,
opening one and `cache-features --prune` (which keeps the caches of the current config) all
name caches through this module."""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from captioning.data.images import ImageLoadError
from captioning.data.problems import MISSING

CACHE_VERSION = 3  # in the key: 1 had no hashes in the index; 2 decoded JPEGs in full
#: Hex digits of a cache's key, and so of its files' names (`cache_files`).
KEY_LENGTH = 20
#: The names of a cache's own files, `KEY.npy` and `KEY.json`.
CACHE_NAME_RE = re.compile(rf"^[0-9a-f]{{{KEY_LENGTH}}}\.(npy|json)$")


def unique_paths(paths: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The resolved paths, first occurrence kept: the rows of a cache, in order."""
    return list(dict.fromkeys(Path(p).resolve() for p in paths))


def cache_identity(*, encoder_config: dict[str, Any], image_size: int,
                   paths: Iterable[str | os.PathLike[str]]) -> tuple[str, list[Path]]:
    """(the key, the rows' image paths) of a cache of `paths`' images. The key hashes the
    encoder config, the input size and each image file's path, size and mtime."""
    rows = unique_paths(paths)
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, "encoder": encoder_config, "image_size": image_size},
                        sort_keys=True).encode())
    for p in rows:
        try:
            st = os.stat(p)
        except OSError as e:  # with data.validate_images false, the first read of the image
            raise ImageLoadError(p, MISSING if isinstance(e, FileNotFoundError)
                                 else f"cannot access file ({e.strerror or e})") from None
        h.update(f"{p}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:KEY_LENGTH], rows


def cache_files(cache_dir: str | os.PathLike[str], key: str) -> tuple[Path, Path]:
    """(array, index) paths of the cache `key`."""
    return Path(cache_dir) / f"{key}.npy", Path(cache_dir) / f"{key}.json"
