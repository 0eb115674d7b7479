"""`captioning cache-features --config ... [--data.* ...] [--verify] [--prune]`: the feature
caches of a config, no training.

Takes the same config files and overrides as `captioning fit`. Without `--verify` or `--prune`
it builds (or finds and checks) the feature cache of every non-empty split for the model's
frozen encoder, on the trainer's device, through the same attach path as `fit`, and logs where
each one is.

* `--verify`: check every split's cache against its index (file size, .npy header, the
  ordered image keys and every block's hash), one line per cache; exit status 1 when one is
  missing or bad. Builds nothing.
* `--prune`: delete from the cache folder (`data.cache_dir`, else the source's) what no split
  of this config uses: the caches of other keys (other encoders, weights, image sets or cache
  versions; also those of other configs sharing the folder), arrays without an index, the
  temporary files of dead writers and unheld lock files. Says what it deleted and the bytes
  freed. With `--dry-run` it says what it would delete, and deletes nothing.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FLAGS = ("--verify", "--prune", "--dry-run")


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        sys.stdout.write(f"{__doc__}\nOther options are those of `captioning fit` "
                         "(see `captioning fit --help`).\n")
        return 0
    flags = {a for a in args if a in FLAGS}
    args = [a for a in args if a not in FLAGS]
    from captioning.commands.lightning import lightning_cli
    from captioning.data.serving import attach_feature_cache

    cli = lightning_cli(args, run=False)
    captioner, dm = cli.model.captioner, cli.datamodule
    if captioner.config.finetune_encoder:
        log.error("net.finetune_encoder is true: a fine-tuned encoder's features are never "
                  "cached (training runs the CNN on every batch)")
        return 2
    if flags:
        keys = split_keys(dm, captioner.feature_cache_key())
        if "--prune" in flags:
            prune(dm.cache_root(), {key for key, _ in keys.values()},
                  dry_run="--dry-run" in flags)
        return verify(dm.cache_root(), keys) if "--verify" in flags else 0
    if not getattr(dm, "feature_cache", False):
        log.warning("data.feature_cache is false: training will not use the cache built now")
    attach_feature_cache(dm, captioner.encoder, captioner.feature_cache_key(),
                         device=cli.trainer.strategy.root_device)
    for split, cache in dm.cache_features().items():
        log.info("%s: %d images, grids %s -> %s", split, len(cache), tuple(cache.shape),
                 cache.array_path)
    return 0


def split_keys(dm: Any, encoder_config: dict[str, Any]) -> dict[str, tuple[str, list[str]]]:
    """{split: (cache key, image keys)} of each non-empty split, after the image checks that
    training does (so that `on_bad_data: skip` leaves out the same images)."""
    from captioning.data.cache_names import cache_identity
    from captioning.data.readers import DATA_SPLITS

    out = {}
    for split in DATA_SPLITS:
        if dm.records(split):
            dm.dataset_for(split)  # sets the split up: its images are checked
            key, paths = cache_identity(encoder_config=encoder_config,
                                        image_size=dm.image_size,
                                        paths=(r.path for r in dm.records(split)))
            out[split] = (key, [str(p) for p in paths])
    return out


def verify(cache_dir: Path, keys: dict[str, tuple[str, list[str]]]) -> int:
    """Check each split's cache fully; one line each. 1 when one is missing or bad, else 0."""
    from captioning.data.cache_names import cache_files
    from captioning.data.features import CacheError, FeatureCache

    status = 0
    for split, (key, paths) in keys.items():
        array_path = cache_files(cache_dir, key)[0]
        t0 = time.perf_counter()
        try:
            cache = FeatureCache.open(cache_dir, key, paths=paths, verify="full")
        except CacheError as e:
            log.error("%s: bad: %s", split, e)
            status = 1
            continue
        if cache is None:
            log.error("%s: missing: %s (build it with `captioning cache-features`)", split,
                      array_path)
            status = 1
            continue
        log.info("%s: ok: %s (%d images, %s bytes, %d blocks hashed in %.2f s)", split,
                 array_path, len(cache), f"{array_path.stat().st_size:,}",
                 len(cache.block_hashes), time.perf_counter() - t0)
    return status


def prunable(cache_dir: Path, keep: set[str]) -> list[Path]:
    """The files of `cache_dir` that `--prune` deletes (see the module's doc)."""
    if not cache_dir.is_dir():
        return []
    return [p for p in sorted(cache_dir.iterdir()) if p.is_file() and _superseded(p, keep)]


def _superseded(p: Path, keep: set[str]) -> bool:
    """Whether `p` is a cache file, lock or temporary that `--prune` deletes; any other file
    in the folder (a dataset's own JSON, a vocabulary, a user's file) is never touched."""
    from captioning.atomic import TEMP_RE, is_stale
    from captioning.data.cache_names import CACHE_NAME_RE
    from captioning.locks import lock_held

    temp = TEMP_RE.match(p.name)
    if temp:
        return bool(CACHE_NAME_RE.match(temp["name"])) and is_stale(p)
    if p.name.startswith("tmp") and p.name.endswith(".npy.tmp"):  # before PIDs in names
        return True
    if p.suffix == ".lock":
        return bool(CACHE_NAME_RE.match(p.stem)) and not lock_held(p.with_suffix(""))
    if not CACHE_NAME_RE.match(p.name) or lock_held(p.with_suffix(".npy")):
        return False
    return p.stem not in keep or not p.with_suffix(".json").exists()


def prune(cache_dir: Path, keep: set[str], *, dry_run: bool = False) -> int:
    """Delete `prunable` files (with `dry_run`, only say which), logging each; returns the
    bytes freed (or that would be)."""
    freed = 0
    for p in prunable(cache_dir, keep):
        try:
            size = p.stat().st_size
            if not dry_run:
                p.unlink()
        except FileNotFoundError:
            continue
        freed += size
        log.info("%s %s (%s bytes)", "would delete" if dry_run else "deleted", p, f"{size:,}")
    log.info("%s %s: %s bytes %s", "dry run, nothing deleted in" if dry_run else "pruned",
             cache_dir, f"{freed:,}", "to free" if dry_run else "freed")
    return freed
