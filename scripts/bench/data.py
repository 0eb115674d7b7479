"""The data every benchmark worker reads: the shapes images, synthetic COCO-like Karpathy files, and
the base spec."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Karpathy's COCO split: 113,287 train (82,783 train + 30,504 restval), 5,000 val, 5,000 test.
COCO_SPLITS = {"train": 82_783, "restval": 30_504, "val": 5_000, "test": 5_000}
COCO_CAPTIONS = 616_767


def make_coco_karpathy(path: Path, *, splits: dict[str, int] | None = None,
                       captions: int = COCO_CAPTIONS,
                       filenames: list[str] | dict[str, list[str]] | None = None,
                       filepath: str = "", seed: int = 0) -> Path:
    """Write a Karpathy split file shaped like dataset_coco.json.

    Captions are 5 per image (a few get 6 or 7, up to `captions`), 8 to 25 words (mean ~10.5,
    like COCO), drawn from a Zipf-distributed 30k-word vocabulary (about 10k words occur 5
    times or more). `filenames` cycles through existing images: one list for every image, or
    one list per split (an image file may be in one split only); default: names that need
    not exist.
    """
    import numpy as np

    rng = np.random.default_rng(seed)
    splits = splits or COCO_SPLITS
    n_images = sum(splits.values())
    per_image = np.full(n_images, 5, dtype=np.int64)
    extra = rng.choice(n_images, size=max(0, captions - 5 * n_images), replace=True)
    np.add.at(per_image, extra, 1)
    n_caps = int(per_image.sum())
    lengths = np.clip(rng.poisson(2.5, n_caps) + 8, 8, 25)
    ranks = np.arange(1, 30_001)
    p = 1.0 / ranks**1.07
    words = [_pseudo_word(i) for i in range(len(ranks))]
    flat = rng.choice(len(ranks), size=int(lengths.sum()), p=p / p.sum())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    split_of = np.repeat(list(splits), list(splits.values()))
    start = dict(zip(splits, np.cumsum([0, *splits.values()])))  # first image of each split
    images, sent, cap = [], 0, 0
    for i in range(n_images):
        sentences = []
        for _ in range(per_image[i]):
            tokens = [words[w] for w in flat[offsets[cap]: offsets[cap + 1]]]
            sentences.append({"tokens": tokens, "raw": " ".join(tokens).capitalize() + ".",
                              "imgid": i, "sentid": sent})
            sent += 1
            cap += 1
        split = str(split_of[i])
        if isinstance(filenames, dict):  # cycled within the split
            name = filenames[split][(i - start[split]) % len(filenames[split])]
        else:
            name = filenames[i % len(filenames)] if filenames else \
                f"COCO_{split}2014_{i:012d}.jpg"
        images.append({"filepath": filepath, "sentids": [s["sentid"] for s in sentences],
                       "filename": name, "imgid": i, "split": split,
                       "sentences": sentences, "cocoid": i + 1})
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        json.dump({"images": images, "dataset": "coco"}, f)
    return path


def _pseudo_word(i: int) -> str:
    """A distinct lowercase word for every index (base-20 syllables)."""
    syll = ["ka", "lo", "mi", "ne", "pu", "ra", "si", "to", "vu", "we",
            "ba", "de", "fi", "go", "hu", "ja", "ku", "le", "mo", "ny"]
    out = ""
    i += 1
    while i:
        i, r = divmod(i, len(syll))
        out += syll[r]
    return out


def make_base(work: Path, *, device: str = "cpu", precision: str = "32-true",
              paper: bool = False, encoder: str = "mobilenet_v2", batch_size: int = 32,
              num_train: int = 640, num_val: int = 64, image_size: int = 224,
              grid_size: int | None = None, tiny: bool = False, channels_last: bool = False,
              steps: int = 24, warmup: int = 2, threads: int | None = None) -> dict[str, Any]:
    """Generate the shapes data under `work` (and, with `paper`, COCO-like captions over its
    images) and return the spec every worker starts from."""
    from captioning.data.shapes import generate_shapes

    shapes = {"num_train": num_train, "num_val": num_val, "num_test": 0,
              "image_size": image_size, "seed": 0}
    t0 = time.perf_counter()
    root = generate_shapes(work / "shapes", **shapes)
    log.info("shapes data ready in %.0f s", time.perf_counter() - t0)
    base = {"device": device, "precision": precision, "paper": paper, "encoder": encoder,
            "grid_size": grid_size, "batch_size": batch_size, "root": str(root),
            "shapes": shapes, "image_size": image_size, "tiny": tiny,
            "cache_dir": str(work / "features"), "workdir": str(work),
            "channels_last": channels_last, "steps": steps, "warmup": warmup,
            # the CPU's default (`auto`: the native score kernel; older revisions: off); the
            # GPU rows run eagerly, the compiled passes have rows of their own
            "fast_path": "auto" if device == "cpu" else "off", "threads": threads}
    if paper:  # COCO-like captions (10k words) over the shapes images
        names = {split: sorted(p.name for p in (root / "images").glob(f"{split}_*.png"))
                 for split in ("train", "val")}
        split_file = make_coco_karpathy(
            work / "paper_captions.json", filenames=names,
            splits={"train": 20_000, "val": num_val}, captions=0)  # 100k captions
        base.update(split_file=str(split_file), image_root=str(root / "images"))
    return base
