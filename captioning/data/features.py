"""Frozen-encoder feature cache: each image's annotation grid computed once, memory-mapped.

The cache is one float16 `.npy` array of shape (N, L, D) plus a JSON index, named by a key
that hashes the encoder config, the input size and every image file (path, size, mtime).
Change any of them and a new cache is built. Arrays are opened lazily in each process, so
datasets holding a cache pickle cleanly into DataLoader workers.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def cache_key(*, encoder_config: dict[str, Any], image_size: int, paths: Sequence[Path]) -> str:
    """Hash of the encoder config, input size and each image file's path, size and mtime."""
    h = hashlib.sha256()
    h.update(json.dumps({"v": CACHE_VERSION, "encoder": encoder_config, "image_size": image_size},
                        sort_keys=True).encode())
    for p in paths:
        st = os.stat(p)
        h.update(f"{Path(p).resolve()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:20]


class _Images(Dataset):
    def __init__(self, paths: Sequence[Path], transform: Callable[[Any], Tensor]) -> None:
        self.paths, self.transform = list(paths), transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> Tensor:
        from captioning.data.images import load_image

        return self.transform(load_image(self.paths[i]))


class FeatureCache:
    """Read-only view of a built cache: `cache[path] -> (L, D) float16 tensor`.

    Grids stay float16 through loading, collation and the host-to-device copy (half the bytes);
    `Captioner.encode` casts them on the device.
    """

    def __init__(self, array_path: str | Path, index: dict[str, int]) -> None:
        self.array_path = Path(array_path)
        self.index = index
        self._array: np.ndarray | None = None  # opened lazily, once per process
        self._rows: dict[str, int] = {}  # path as given -> row, so each path resolves once

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_array"] = None  # never pickle an open memory map into a worker
        return state

    @property
    def array(self) -> np.ndarray:
        if self._array is None:
            self._array = np.load(self.array_path, mmap_mode="r")
        return self._array

    @property
    def shape(self) -> tuple[int, int]:
        """(L, D) of one entry."""
        return tuple(self.array.shape[1:])  # type: ignore[return-value]

    def __len__(self) -> int:
        return len(self.index)

    def __contains__(self, path: str | Path) -> bool:
        return str(Path(path).resolve()) in self.index

    def __getitem__(self, path: str | Path) -> Tensor:
        key = str(path)
        row = self._rows.get(key)
        if row is None:
            row = self._rows[key] = self.index[str(Path(path).resolve())]
        return torch.from_numpy(np.array(self.array[row]))  # a float16 copy out of the map

    @classmethod
    def open(cls, cache_dir: str | Path, key: str) -> FeatureCache | None:
        """The complete cache for `key`, or None."""
        cache_dir = Path(cache_dir)
        meta_path, array_path = cache_dir / f"{key}.json", cache_dir / f"{key}.npy"
        if not (meta_path.is_file() and array_path.is_file()):
            return None
        try:
            meta = json.loads(meta_path.read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if not meta.get("complete"):
            return None
        return cls(array_path, {p: i for i, p in enumerate(meta["paths"])})

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
    ) -> FeatureCache:
        """Open the cache for these images and encoder, building it first if needed.
        `progress`: show a progress bar (a string labels it)."""
        paths = list(dict.fromkeys(Path(p).resolve() for p in paths))
        key = cache_key(encoder_config=encoder_config, image_size=image_size, paths=paths)
        found = cls.open(cache_dir, key)
        if found is not None:
            log.info("feature cache hit: %s (%d images)", found.array_path, len(found))
            return found
        cache_dir = Path(cache_dir)
        cache_dir.mkdir(parents=True, exist_ok=True)
        device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        was_training = encoder.training
        encoder.eval()
        orig_device = next(encoder.parameters()).device
        encoder.to(device)
        loader = DataLoader(_Images(paths, transform), batch_size=batch_size,
                            num_workers=num_workers, pin_memory=device.type == "cuda")
        fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".npy.tmp")
        os.close(fd)
        try:
            _encode_to_npy(tmp, encoder, loader, device, len(paths), progress)
            os.replace(tmp, cache_dir / f"{key}.npy")
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        finally:
            encoder.to(orig_device)
            encoder.train(was_training)
        meta = {"complete": True, "version": CACHE_VERSION, "encoder": encoder_config,
                "image_size": image_size, "paths": [str(p) for p in paths]}
        (cache_dir / f"{key}.json").write_text(json.dumps(meta))
        log.info("feature cache built: %s (%d images)", cache_dir / f"{key}.npy", len(paths))
        return cls(cache_dir / f"{key}.npy", {str(p): i for i, p in enumerate(paths)})


def _encode_to_npy(file: str, encoder: nn.Module, loader: DataLoader, device: torch.device,
                   total: int, progress: bool | str) -> None:
    """Write the (total, L, D) float16 grids of the `loader`'s images to the `.npy` `file`,
    batch by batch through a memory map."""
    array = None
    label = progress if isinstance(progress, str) else "caching encoder features"
    bar = _progress(total, bool(progress), desc=label)
    row = 0
    for images in loader:
        feats = encoder(images.to(device, non_blocking=True)).to("cpu", torch.float16)
        if array is None:
            array = np.lib.format.open_memmap(
                file, mode="w+", dtype=np.float16, shape=(total, *feats.shape[1:]))
        array[row : row + len(feats)] = feats.numpy()
        row += len(feats)
        bar.update(len(feats))
    bar.close()
    if array is None:
        raise ValueError("no images to cache")
    array.flush()


def attach_feature_cache(datamodule: Any, encoder: nn.Module, key: dict[str, Any], *,
                         strategy: Any = None, device: str | torch.device | None = None) -> None:
    """Serve `datamodule`'s inputs from the feature cache of a frozen `encoder`: the one attach
    path of `fit`, `cache-features` and the benchmark.

    `key` is what the grids depend on besides the images (`Captioner.feature_cache_key()`).
    With a Lightning `strategy` (several processes), rank zero builds the cache while the
    others wait at a barrier, then open it. Building never shifts the RNG streams.
    """
    from lightning.pytorch.utilities.seed import isolate_rng

    if strategy is not None and device is None:
        device = strategy.root_device
    first = strategy is None or strategy.is_global_zero
    with isolate_rng():
        if not first:
            strategy.barrier("feature-cache")  # wait for rank zero's build, then open it
        datamodule.use_encoder_cache(encoder, key, device=device)
        if first and strategy is not None:
            strategy.barrier("feature-cache")


def _progress(total: int, enabled: bool, desc: str) -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, desc=desc, unit="img")
