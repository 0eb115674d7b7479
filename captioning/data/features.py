"""Frozen-encoder feature cache: each image's annotation grid computed once, memory-mapped.

One float16 `.npy` array (N, L, D) and a JSON index, named by a key hashing the encoder config,
the input size and every image file (path, size, mtime): a change builds a new cache. Arrays
open lazily in each process, so datasets holding a cache pickle cleanly into DataLoader workers.

The index (`KEY.json`) is the cache's truth. It records the array file's byte size, the .npy
header's shape, dtype and data offset, a blake2b-128 hash of each block of rows (`block_rows`
rows, at most 256 and about 1 MiB), and the ordered image keys with a hash of them. Opening a
cache always checks the size, the header and the keys' hash (and, when building, that the keys
are the records' paths in order); `verify` says what else:

* `full`: hash every block now (the cost, as a share of an epoch: docs/benchmarks.md);
* `lazy`: hash a block the first time one of its rows is read, in each process (DataLoader
  workers included); a mismatch there removes the index and stops the run with one line;
* `size`: no hashes.

`build` rebuilds a cache that fails its check, with a warning. It holds a lock on the cache
file (`captioning.locks`: a second process waits, then uses the cache), preallocates the file
(a full disk is one `CacheError` with the bytes needed, not SIGBUS), writes through
`captioning.atomic` (PIDs in temporary names, umask permissions; temporaries of dead writers
are removed) and turns SIGTERM into `Terminated` after removing its temporary file.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import math
import os
import shutil
import warnings
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from captioning.atomic import remove_stale_temporaries, write_atomic, write_json_atomic
from captioning.choices import check_choice
from captioning.data.cache_names import CACHE_VERSION, cache_files, cache_identity
from captioning.data.datasets import ImageInputs
from captioning.locks import exclusive_lock, sigterm_raises

log = logging.getLogger(__name__)

CacheVerify = Literal["full", "lazy", "size"]  # what is checked when a cache is opened
BLOCK_BYTES = 1 << 20
MAX_BLOCK_ROWS = 256
DTYPE = np.dtype(np.float16)
HASH = "blake2b-128"  # of each block's bytes, in the index as "hash"
_NO_SPACE = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}
_INDEX_KEYS = ("bytes", "shape", "dtype", "offset", "block_rows", "blocks", "paths", "paths_hash")


class CacheError(Exception):
    """A feature cache that fails its check or cannot be written: one line, naming the file."""

    def __str__(self) -> str:  # from a DataLoader worker: "Caught ... CacheError: <line>"
        text = super().__str__().strip()
        return text.splitlines()[-1].split("CacheError: ", 1)[-1] if text else text


def digest(data: Any) -> str:
    """blake2b-128 of a bytes-like object (a C-contiguous array included), in hex."""
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def keys_digest(keys: Sequence[str]) -> str:
    """The hash of a cache's ordered image keys."""
    return digest("\n".join(keys).encode())


def block_rows(row_bytes: int) -> int:
    """Rows per hashed block: about `BLOCK_BYTES`, between 1 and `MAX_BLOCK_ROWS`."""
    return max(1, min(MAX_BLOCK_ROWS, BLOCK_BYTES // max(1, row_bytes)))


def npy_header(path: Path) -> tuple[list[int], str, int]:
    """(shape, dtype, data offset) of a C-order `.npy` file's header."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else \
            np.lib.format.read_array_header_2_0
        shape, fortran, dtype = read(f)
        if fortran:
            raise ValueError("Fortran order")
        return list(shape), dtype.str, f.tell()


def check_cache(meta: dict[str, Any], array_path: Path, *, hashes: bool,
                paths: Sequence[str] | None = None) -> str | None:
    """What differs between the array file and its index `meta`, or None when they agree.
    `hashes`: hash every block too; `paths`: the image keys the rows must be, in order."""
    try:
        size = os.stat(array_path).st_size
        if size != meta["bytes"]:
            return f"{size:,} bytes on disk, the index says {meta['bytes']:,}"
        shape, dtype, offset = npy_header(array_path)
    except FileNotFoundError:
        return "the .npy file is missing"
    except (OSError, ValueError, KeyError) as e:
        return f"unreadable ({type(e).__name__}: {e})"
    if [shape, dtype, offset] != [meta["shape"], meta["dtype"], meta["offset"]]:
        return (f"the .npy header says shape {tuple(shape)} {dtype} at byte {offset}, the index "
                f"{tuple(meta['shape'])} {meta['dtype']} at byte {meta['offset']}")
    n, blocks = meta["block_rows"], meta["blocks"]  # one hash per block: ceil(rows / n)
    if not (type(n) is int and n > 0 and isinstance(blocks, list)
            and len(blocks) == math.ceil(shape[0] / n)):
        return f"the index's block hashes do not cover its {shape[0]} rows ({n!r} a block)"
    if len(meta["paths"]) != shape[0] or keys_digest(meta["paths"]) != meta["paths_hash"]:
        return "the index's image keys do not match their hash (edited or reordered)"
    if paths is not None and list(paths) != meta["paths"]:
        return "the index's image keys are not the records' images in order"
    if hashes:
        array = np.memmap(array_path, DTYPE, mode="r", offset=offset, shape=tuple(shape))
        got = block_digests(array, meta["block_rows"])
        bad = [b for b, (h, want) in enumerate(zip(got, meta["blocks"])) if h != want]
        if bad:
            first = bad[0] * meta["block_rows"]
            return (f"{len(bad)} of {len(meta['blocks'])} blocks differ from their hashes "
                    f"(first: rows {first}-{min(first + meta['block_rows'], shape[0]) - 1})")
    return None


def _block(array: np.ndarray, block: int, rows: int) -> np.ndarray:
    return array[block * rows:(block + 1) * rows]


def block_digests(array: np.ndarray, rows: int) -> list[str]:
    """The hash of each block of `rows` rows, hashed in parallel threads (hashlib releases the
    GIL on large buffers, and page faults of a memory map then overlap too)."""
    blocks = range(math.ceil(len(array) / rows))
    with ThreadPoolExecutor(max(1, min(8, os.cpu_count() or 1))) as pool:
        return list(pool.map(lambda b: digest(_block(array, b, rows)), blocks))


def read_index(index_path: Path) -> dict[str, Any] | None:
    """The index of a complete cache; None when there is none. Raises `CacheError` when it
    exists but cannot be read."""
    try:
        meta = json.loads(index_path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:
        raise CacheError(f"feature cache index {index_path}: unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("version") != CACHE_VERSION or \
            not all(k in meta for k in _INDEX_KEYS):
        raise CacheError(f"feature cache index {index_path}: not a complete version-"
                         f"{CACHE_VERSION} cache index")
    return meta if meta.get("complete") else None


def read_only_tensor(array: np.ndarray) -> Tensor:
    """A tensor over a read-only array (a view of the cache's map): never write into it."""
    with warnings.catch_warnings():  # torch's, that the array is read-only
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(array)


class FeatureCache:
    """Read-only view of a built, checked cache: `cache[path] -> (L, D) float16 tensor`.

    Grids stay float16 through loading, collation and the host-to-device copy (half the bytes);
    `Captioner.encode` casts them on the device. With `verify="lazy"`, each process hashes a
    block the first time it reads one of its rows.
    """

    def __init__(self, array_path: str | Path, meta: dict[str, Any], *,
                 verify: str = "size") -> None:
        check_choice("verify", verify, CacheVerify)
        self.array_path = Path(array_path)
        self.index: dict[str, int] = {p: i for i, p in enumerate(meta["paths"])}
        self.verify = verify
        self.offset, self.block_rows = int(meta["offset"]), int(meta["block_rows"])
        self.block_hashes: list[str] = list(meta["blocks"])
        self._shape = tuple(meta["shape"])
        self._array: np.ndarray | None = None  # opened lazily, once per process
        self._rows: dict[str, int] = {}  # path as given -> row, so each path resolves once
        self._checked: set[int] = set()  # blocks this process has hashed (lazy mode)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_array"] = None  # never pickle an open memory map into a worker
        state["_checked"] = set()  # each process checks what it reads itself
        return state

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.memmap(self.array_path, DTYPE, mode="r", offset=self.offset,
                                    shape=self._shape)
        return self._array

    @property
    def shape(self) -> tuple[int, int]:
        """(L, D) of one entry."""
        return self._shape[1:]  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, path: str | Path) -> bool:
        return str(Path(path).resolve()) in self.index

    def __getitem__(self, path: str | Path) -> Tensor:
        return torch.from_numpy(np.array(self.array[self._row(path)]))  # a copy out of the map

    def view(self, path: str | Path) -> Tensor:
        """`self[path]` without its copy: a view of the read-only map, for a batch's stack
        (`CachedInputs`), then the one copy. Never write into it: a write faults."""
        return read_only_tensor(self.array[self._row(path)])

    def rows(self, paths: Sequence[str | Path]) -> np.ndarray:
        """(N,) int64 the row of each path (`GridRows`), no block hashed."""
        return np.fromiter((self._row(p, check=False) for p in paths), np.int64, len(paths))

    def check_every_block(self) -> None:
        """With `verify="lazy"`, hash every block now (all rows are about to be read)."""
        if self.verify != "lazy":
            return
        found = block_digests(self.array, self.block_rows)  # in parallel threads
        for b in (b for b, h in enumerate(found) if h != self.block_hashes[b]):
            self._check_block(b)  # raises: the first bad block, as its first read would
        self._checked.update(range(len(found)))

    def _row(self, path: str | Path, *, check: bool = True) -> int:
        """The row of `path`, its block hashed first where `verify` is lazy (and `check`)."""
        key = str(path)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = self.index[str(Path(path).resolve())]
        if check and self.verify == "lazy" and row // self.block_rows not in self._checked:
            self._check_block(row // self.block_rows)
        return row

    def _check_block(self, block: int) -> None:
        if digest(_block(self.array, block, self.block_rows)) != self.block_hashes[block]:
            index = self.array_path.with_suffix(".json")
            index.unlink(missing_ok=True)  # a known-bad cache: the next run rebuilds it
            first = block * self.block_rows
            last = min(first + self.block_rows, self._shape[0]) - 1
            raise CacheError(f"feature cache {self.array_path}: rows {first}-{last} differ from "
                             f"their hash in {index.name}; removed the index, so that the next "
                             "run rebuilds the cache")
        self._checked.add(block)

    @classmethod
    def open(cls, cache_dir: str | Path, key: str, *, paths: Sequence[str] | None = None,
             verify: str = "full") -> FeatureCache | None:
        """The complete cache for `key`, checked (`verify`, `paths`: see `check_cache`); None
        when there is none. Raises `CacheError` naming the file and what differs."""
        array_path, index_path = cache_files(cache_dir, key)
        meta = read_index(index_path)
        if meta is None:
            return None
        what = check_cache(meta, array_path, hashes=verify == "full", paths=paths)
        if what is not None:
            raise CacheError(f"feature cache {array_path}: {what}")
        return cls(array_path, meta, verify=verify)

    @classmethod
    @torch.no_grad()
    def build(
        cls,
        *,
        cache_dir: str | Path,
        encoder: nn.Module,
        encoder_config: dict[str, Any],
        image_size: int,
        paths: Sequence[str | Path],
        transform: Callable[[Any], Tensor],
        batch_size: int = 64,
        num_workers: int = 0,
        device: str | torch.device | None = None,
        progress: bool | str = True,
        verify: str = "full",
        checked: Collection[str] = (),
    ) -> FeatureCache:
        """Open the cache for these images and encoder, building it first if it is missing or
        fails its check (`verify`; by size only where its array file is one of `checked`, which
        another process has just checked). `progress`: show a progress bar (a string labels
        it)."""
        key, paths = cache_identity(encoder_config=encoder_config, image_size=image_size,
                                    paths=paths)
        cache_dir = Path(cache_dir)
        if str(cache_files(cache_dir, key)[0]) in checked:
            verify = "size"
        keys = [str(p) for p in paths]
        if cache_dir.is_dir():
            _remove_stale(cache_dir)
            found = _open_quietly(cache_dir, key, keys, verify)
            if found is not None:
                log.info("feature cache hit: %s (%d images)", found.array_path, len(found))
                return found
        cache_dir.mkdir(parents=True, exist_ok=True)
        array_path, index_path = cache_files(cache_dir, key)
        with sigterm_raises(), \
                exclusive_lock(array_path, what=f"the feature cache {array_path}"):
            found = None
            try:  # built by another process while this one waited?
                found = cls.open(cache_dir, key, paths=keys, verify=verify)
            except CacheError as e:
                log.warning("%s; rebuilding it", e)
                index_path.unlink(missing_ok=True)  # until rebuilt, the cache is not complete
            if found is not None:
                return found
            meta = {"complete": True, "version": CACHE_VERSION, "encoder": encoder_config,
                    "image_size": image_size, "file": array_path.name}
            # decoded as training, `caption` and `predict` decode them: the same grids
            images = ImageInputs(paths, transform, min_side=image_size)
            with contextlib.closing(_batches(encoder, images, batch_size,
                                             num_workers, device)) as batches:
                meta.update(_encode(array_path, batches, len(paths), progress))
            meta.update(paths=keys, paths_hash=keys_digest(keys))
            with _space_errors(index_path, {}):
                write_json_atomic(index_path, meta, indent=None)
        log.info("feature cache built: %s (%d images)", array_path, len(paths))
        return cls(array_path, meta, verify=verify)


def _remove_stale(cache_dir: Path) -> None:
    try:
        remove_stale_temporaries(cache_dir)
    except OSError as e:  # a read-only shared cache: nothing to clean here
        log.debug("could not clean %s: %s", cache_dir, e)


def _open_quietly(cache_dir: Path, key: str, keys: list[str], verify: str
                  ) -> FeatureCache | None:
    try:
        return FeatureCache.open(cache_dir, key, paths=keys, verify=verify)
    except CacheError:
        return None  # checked again, and reported, under the lock


def _batches(encoder: nn.Module, images: ImageInputs, batch_size: int, num_workers: int,
             device: str | torch.device | None) -> Iterator[np.ndarray]:
    """The float16 grids of the images, batch by batch, from the frozen `encoder` in eval mode
    on `device` (restored afterwards)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    was_training = encoder.training
    orig_device = next(encoder.parameters()).device
    encoder.eval().to(device)
    loader = DataLoader(images, batch_size=batch_size,
                        num_workers=num_workers, pin_memory=device.type == "cuda")
    try:
        for batch in loader:
            yield encoder(batch.to(device, non_blocking=True)).to("cpu", torch.float16).numpy()
    finally:
        encoder.to(orig_device)
        encoder.train(was_training)


def _encode(target: Path, batches: Iterator[np.ndarray], total: int, progress: bool | str
            ) -> dict[str, Any]:
    """Write the (total, L, D) float16 grids of `batches` to the `.npy` `target` atomically,
    through a memory map of a preallocated file; returns the index entries of the array."""
    info: dict[str, Any] = {}
    label = progress if isinstance(progress, str) else "caching encoder features"

    def write(tmp: Path) -> None:
        array, row = None, 0
        with _progress(total, bool(progress), desc=label) as bar:  # closed when interrupted
            for feats in batches:
                if array is None:
                    array = _preallocate(tmp, (total, *feats.shape[1:]), info)
                array[row: row + len(feats)] = feats
                row += len(feats)
                bar.update(len(feats))
        if array is None:
            raise ValueError("no images to cache")
        array.flush()
        info["blocks"] = block_digests(array, info["block_rows"])

    with _space_errors(target, info):
        write_atomic(target, write)
    return info


def _preallocate(tmp: Path, shape: tuple[int, ...], info: dict[str, Any]) -> np.ndarray:
    """Write the .npy header for `shape`, allocate the whole file (`posix_fallocate`: a full
    disk fails here, not with SIGBUS later) and map its data."""
    header = {"descr": np.lib.format.dtype_to_descr(DTYPE), "fortran_order": False,
              "shape": shape}
    row_bytes = math.prod(shape[1:]) * DTYPE.itemsize
    with open(tmp, "r+b") as f:
        np.lib.format.write_array_header_1_0(f, header)
        offset = f.tell()
        info.update(shape=list(shape), dtype=DTYPE.str, offset=offset,
                    bytes=offset + shape[0] * row_bytes, hash=HASH,
                    block_rows=block_rows(row_bytes))
        try:
            os.posix_fallocate(f.fileno(), 0, info["bytes"])
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):
                raise
            os.ftruncate(f.fileno(), info["bytes"])  # no preallocation on this file system
    return np.memmap(tmp, DTYPE, mode="r+", offset=offset, shape=shape)


@contextlib.contextmanager
def _space_errors(target: Path, info: dict[str, Any]) -> Iterator[None]:
    """A full disk or a file-size limit while writing `target` becomes one `CacheError` line
    (with the bytes needed: `info["bytes"]`, when known)."""
    try:
        yield
    except OSError as e:
        if e.errno not in _NO_SPACE:
            raise
        needed = info.get("bytes")
        free = shutil.disk_usage(target.parent).free
        need = f"{needed:,} bytes needed" if needed else "no room"
        raise CacheError(f"cannot write the feature cache {target}: {need} in {target.parent} "
                         f"({os.strerror(e.errno)}; {free:,} bytes free there)") from None


def _progress(total: int, enabled: bool, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="img")
