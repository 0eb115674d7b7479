"""Synthetic shapes dataset: the project's embedded default for the demo and the tests.

Each scene holds 1 to 3 non-overlapping shapes (colour x shape x size) on a dark, mildly noisy
background, drawn anti-aliased (supersampled, then downsampled). Each image has exactly five
reference captions. The first, canonical one always lists the objects left to right joined by
"to the left of" ("a large red circle to the left of a small blue square"); the other four are
drawn from wording variants (relations right of / above / below / between, counts, no sizes).
No two objects in a scene share both colour and shape, and their centres differ horizontally,
so "left to right" is unambiguous.

Output under `root` (see `generate_shapes`): images/{split}_{idx:05d}.png, dataset_shapes.json
(Karpathy layout), annotations/captions_{split}.json (raw COCO layout), boxes.json and
manifest.json (the generation parameters; written last, so it marks a complete dataset).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Collection, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from captioning.atomic import is_stale, temporary_name
from captioning.locks import exclusive_lock, sigterm_raises
from captioning.vocab import tokenize

log = logging.getLogger(__name__)

#: Colour words and their RGB values; pairwise RGB distance >= 120.
COLOR_RGB: dict[str, tuple[int, int, int]] = {
    "red": (225, 45, 45),
    "green": (45, 195, 65),
    "blue": (55, 105, 245),
    "yellow": (240, 220, 45),
    "purple": (165, 65, 220),
    "white": (235, 235, 235),
}
COLORS: tuple[str, ...] = tuple(COLOR_RGB)
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "diamond")
SIZES: tuple[str, ...] = ("small", "large")
#: Bounding-box side of each size, as a fraction of the image side.
SIZE_FRACTION: dict[str, float] = {"small": 0.19, "large": 0.32}
SPLITS: tuple[str, ...] = ("train", "val", "test")

SPLIT_FILE = "dataset_shapes.json"
BOXES_FILE = "boxes.json"
MANIFEST_FILE = "manifest.json"
IMAGE_DIR = "images"
#: Bump when the generator's output changes, so cached datasets are regenerated.
GENERATOR_VERSION = 1
#: The embedded default dataset: one home for its folder and parameters (`generate_shapes`,
#: `ShapesSource`, `captioning shapes`, configs/data/shapes.yaml), so that a dataset written by
#: one of them is the one the others look for, not replaced as a dataset of other parameters.
DEFAULT_ROOT = "data/shapes"
DEFAULT_PARAMS = {"num_train": 4000, "num_val": 250, "num_test": 500, "image_size": 128,
                  "seed": 0}

_BACKGROUND = (28, 28, 34)
_SUPERSAMPLE = 2
_PNG_LEVEL = 1  # the noise makes higher levels slow for little gain
_SHAPE_SET = frozenset(SHAPES)
_COLOR_SET = frozenset(COLORS)
_SIZE_SET = frozenset(SIZES)
_COUNT_WORDS = {2: "two", 3: "three"}


@dataclass(frozen=True)
class _Obj:
    color: str
    shape: str
    size: str
    x: float  # bbox left, pixels
    y: float  # bbox top
    side: float  # bbox width == height

    @property
    def cx(self) -> float:
        return self.x + self.side / 2

    @property
    def cy(self) -> float:
        return self.y + self.side / 2

    def phrase(self, *, size: bool = True) -> str:
        return f"a {self.size} {self.color} {self.shape}" if size else \
            f"a {self.color} {self.shape}"


# --------------------------------------------------------------------------------------------
# Scenes


def _place(rng: np.random.Generator, image_size: int) -> list[_Obj]:
    """Sample 1-3 non-overlapping objects with distinct (colour, shape) and distinct x-centres."""
    margin = max(1.0, 0.03 * image_size)
    gap = max(1.0, 0.03 * image_size)  # min distance between boxes
    min_dx = 0.06 * image_size  # min distance between x-centres
    while True:
        n = int(rng.integers(1, 4))
        objs: list[_Obj] = []
        for _ in range(n):
            for _attempt in range(200):
                color = COLORS[int(rng.integers(len(COLORS)))]
                shape = SHAPES[int(rng.integers(len(SHAPES)))]
                size = SIZES[int(rng.integers(len(SIZES)))]
                side = SIZE_FRACTION[size] * image_size
                x = float(rng.uniform(margin, image_size - margin - side))
                y = float(rng.uniform(margin, image_size - margin - side))
                cand = _Obj(color, shape, size, x, y, side)
                if all(_compatible(cand, o, gap, min_dx) for o in objs):
                    objs.append(cand)
                    break
            else:
                break  # could not place: resample the whole scene
        if len(objs) == n:
            return sorted(objs, key=lambda o: o.cx)


def _compatible(a: _Obj, b: _Obj, gap: float, min_dx: float) -> bool:
    if (a.color, a.shape) == (b.color, b.shape) or abs(a.cx - b.cx) < min_dx:
        return False
    apart_x = a.x + a.side + gap <= b.x or b.x + b.side + gap <= a.x
    apart_y = a.y + a.side + gap <= b.y or b.y + b.side + gap <= a.y
    return apart_x or apart_y


def _jitter(rgb: Sequence[int], rng: np.random.Generator, amount: int) -> tuple[int, ...]:
    return tuple(int(np.clip(c + rng.integers(-amount, amount + 1), 0, 255)) for c in rgb)


def _render(objs: Sequence[_Obj], image_size: int, rng: np.random.Generator) -> Image.Image:
    """Draw the scene at 2x, downsample (anti-aliasing), add mild Gaussian noise."""
    s = _SUPERSAMPLE
    big = Image.new("RGB", (image_size * s, image_size * s), _jitter(_BACKGROUND, rng, 6))
    draw = ImageDraw.Draw(big)
    for o in objs:
        fill = _jitter(COLOR_RGB[o.color], rng, 12)
        x0, y0, x1, y1 = o.x * s, o.y * s, (o.x + o.side) * s, (o.y + o.side) * s
        if o.shape == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif o.shape == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif o.shape == "triangle":
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)
        elif o.shape == "diamond":
            mx, my = (x0 + x1) / 2, (y0 + y1) / 2
            draw.polygon([(mx, y0), (x1, my), (mx, y1), (x0, my)], fill=fill)
        else:  # pragma: no cover - SHAPES is closed
            raise ValueError(o.shape)
    img = big.resize((image_size, image_size), Image.Resampling.BOX)
    arr = np.asarray(img, dtype=np.float32)
    arr = arr + rng.normal(0.0, 4.0, size=arr.shape).astype(np.float32)
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), "RGB")


# --------------------------------------------------------------------------------------------
# Captions


def _location(o: _Obj, image_size: int) -> str:
    col = min(2, int(3 * o.cx / image_size))
    row = min(2, int(3 * o.cy / image_size))
    return [["top left corner", "top", "top right corner"],
            ["left side", "centre", "right side"],
            ["bottom left corner", "bottom", "bottom right corner"]][row][col]


def _join(phrases: Sequence[str]) -> str:
    return phrases[0] if len(phrases) == 1 else ", ".join(phrases[:-1]) + " and " + phrases[-1]


def canonical_caption(objs: Sequence[_Obj]) -> str:
    """Objects left to right, joined by 'to the left of'."""
    return " to the left of ".join(o.phrase() for o in sorted(objs, key=lambda o: o.cx))


def _variants(objs: Sequence[_Obj], image_size: int) -> list[str]:
    full = [o.phrase() for o in objs]
    bare = [o.phrase(size=False) for o in objs]
    out = [f"there is {_join(full)}", _join(bare)]
    if len(objs) == 1:
        o = objs[0]
        out += [f"{full[0]} on a dark background",
                f"a single {o.size} {o.color} {o.shape} near the {_location(o, image_size)}",
                f"an image with {full[0]}"]
        return out
    out += [f"{_COUNT_WORDS[len(objs)]} shapes, {_join(full)}",
            " to the right of ".join(reversed(full))]
    if len(objs) == 2:
        out.append(f"{full[0]} next to {full[1]}")
    else:
        out += [f"{full[1]} between {full[0]} and {full[2]}",
                f"{full[0]} on the left, {full[1]} in the middle and {full[2]} on the right"]
    # A vertical relation for the pair that is furthest apart vertically, when clear enough.
    pairs = [(a, b) for i, a in enumerate(objs) for b in objs[i + 1:]]
    a, b = max(pairs, key=lambda p: abs(p[0].cy - p[1].cy))
    if abs(a.cy - b.cy) >= 0.25 * image_size:
        upper, lower = (a, b) if a.cy < b.cy else (b, a)
        out.append(f"{upper.phrase()} above {lower.phrase()}")
        out.append(f"{lower.phrase(size=False)} below {upper.phrase(size=False)}")
    return out


def scene_captions(objs: Sequence[_Obj], image_size: int, rng: np.random.Generator) -> list[str]:
    """Exactly five distinct captions: the canonical one, then four sampled variants."""
    canon = canonical_caption(objs)
    pool = list(dict.fromkeys(v for v in _variants(objs, image_size) if v != canon))
    order = rng.permutation(len(pool))
    chosen = [pool[i] for i in order[:4]]
    assert len(chosen) == 4, pool
    return [canon, *chosen]


def shape_of(word: str, names: Collection[str]) -> str | None:
    """The object name (one of `names`) that `word` names, singular or plural ("-s", "-es");
    None for any other word. The one rule of `parse_objects` and of pointing accuracy."""
    if word in names:
        return word
    for suffix in ("es", "s"):
        if word.endswith(suffix) and word[: -len(suffix)] in names:
            return word[: -len(suffix)]
    return None


def bound_colour(tokens: Sequence[str], t: int, *, colours: Collection[str],
                 sizes: Collection[str]) -> str | None:
    """The colour word bound to the shape word tokens[t]: the word right before it, or the one
    before a single size word ("red large circle"); None when neither is a colour. The one
    binding rule of `parse_objects` and of pointing accuracy's referred objects."""
    before = tokens[t - 1] if t >= 1 else None
    if before in colours:
        return before
    if before in sizes and t >= 2 and tokens[t - 2] in colours:
        return tokens[t - 2]
    return None


def parse_objects(caption: str) -> set[tuple[str, str]]:
    """The (colour, shape) pairs a caption names: each shape noun (singular or plural) with
    the colour `bound_colour` binds to it."""
    tokens = tokenize(caption)
    found: set[tuple[str, str]] = set()
    for t, tok in enumerate(tokens):
        if (shape := shape_of(tok, _SHAPE_SET)) and (
                colour := bound_colour(tokens, t, colours=_COLOR_SET, sizes=_SIZE_SET)):
            found.add((colour, shape))
    return found


def scene_objects(boxes_entry: Mapping[str, Any] | Iterable[Mapping[str, Any]],
                  ) -> set[tuple[str, str]]:
    """(colour, shape) pairs of a boxes.json image entry or of its `objects` list."""
    objs = boxes_entry["objects"] if isinstance(boxes_entry, Mapping) else boxes_entry
    return {(o["color"], o["shape"]) for o in objs}


# --------------------------------------------------------------------------------------------
# Generation


def _params(num_train: int, num_val: int, num_test: int, image_size: int,
            seed: int) -> dict[str, Any]:
    return {"generator": "captioning.data.shapes", "version": GENERATOR_VERSION,
            "num_train": num_train, "num_val": num_val, "num_test": num_test,
            "image_size": image_size, "seed": seed}


def _read_manifest(root: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((root / MANIFEST_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def is_complete(root: str | os.PathLike[str], params: Mapping[str, Any]) -> bool:
    """True when `root` holds a finished dataset generated with exactly `params`."""
    root = Path(root)
    if _read_manifest(root) != dict(params):
        return False
    files = [root / SPLIT_FILE, root / BOXES_FILE,
             *(root / "annotations" / f"captions_{s}.json" for s in SPLITS)]
    if not all(f.is_file() for f in files):
        return False
    total = params["num_train"] + params["num_val"] + params["num_test"]
    try:
        with os.scandir(root / IMAGE_DIR) as it:
            n_png = sum(1 for e in it if e.name.endswith(".png"))
    except OSError:
        return False
    return n_png == total


def _dump(obj: Any, path: Path) -> None:
    path.write_text(json.dumps(obj, separators=(",", ":")), encoding="utf-8")


def _make_image(out: Path, split_index: int, split: str, idx: int,
                size: int, seed: int) -> tuple[str, list[_Obj], list[str]]:
    # One independent stream per image: an image does not depend on the split sizes or on
    # the order in which images are generated.
    rng = np.random.default_rng([seed, split_index, idx])
    objs = _place(rng, size)
    img = _render(objs, size, rng)
    captions = scene_captions(objs, size, rng)
    file_name = f"{split}_{idx:05d}.png"
    img.save(out / IMAGE_DIR / file_name, format="PNG", compress_level=_PNG_LEVEL)
    return file_name, objs, captions


def _write_dataset(out: Path, params: Mapping[str, Any]) -> None:
    size, seed = params["image_size"], params["seed"]
    (out / IMAGE_DIR).mkdir(parents=True)
    (out / "annotations").mkdir()
    jobs = [(split_index, split, idx) for split_index, split in enumerate(SPLITS)
            for idx in range(params[f"num_{split}"])]
    workers = max(1, min(8, os.cpu_count() or 1, len(jobs) // 64))
    pool = ThreadPoolExecutor(workers)  # PNG encoding and resizing release the GIL
    try:
        results = list(pool.map(lambda j: _make_image(out, *j, size, seed), jobs))
    finally:  # interrupted: drop the queued images, wait only for those being drawn
        pool.shutdown(wait=True, cancel_futures=True)

    karpathy: list[dict[str, Any]] = []
    boxes: list[dict[str, Any]] = []
    coco: dict[str, dict[str, list]] = {s: {"images": [], "annotations": []} for s in SPLITS}
    sent_id = 0
    for image_id, ((_, split, _), (file_name, objs, captions)) in enumerate(zip(jobs, results)):
        sentences = [{"tokens": tokenize(c), "raw": c, "imgid": image_id,
                      "sentid": sent_id + k} for k, c in enumerate(captions)]
        karpathy.append({"filepath": IMAGE_DIR, "filename": file_name, "split": split,
                         "imgid": image_id, "cocoid": image_id,
                         "sentids": [s["sentid"] for s in sentences], "sentences": sentences})
        coco[split]["images"].append({"id": image_id, "file_name": file_name,
                                      "width": size, "height": size})
        coco[split]["annotations"] += [{"id": sent_id + k, "image_id": image_id,
                                        "caption": c} for k, c in enumerate(captions)]
        boxes.append({"image_id": image_id, "file_name": file_name, "width": size,
                      "height": size,
                      "objects": [{"color": o.color, "shape": o.shape, "size": o.size,
                                   "bbox": [round(o.x, 2), round(o.y, 2),
                                            round(o.side, 2), round(o.side, 2)]}
                                  for o in objs]})
        sent_id += len(captions)
    _dump({"dataset": "shapes", "images": karpathy}, out / SPLIT_FILE)
    for split in SPLITS:
        _dump({"info": {"description": f"captioning shapes dataset, {split} split"},
               "images": coco[split]["images"], "annotations": coco[split]["annotations"]},
              out / "annotations" / f"captions_{split}.json")
    _dump({"images": boxes}, out / BOXES_FILE)
    _dump(dict(params), out / MANIFEST_FILE)  # last: marks the dataset complete


def generate_shapes(
    root: str | os.PathLike[str],
    *,
    num_train: int = DEFAULT_PARAMS["num_train"],
    num_val: int = DEFAULT_PARAMS["num_val"],
    num_test: int = DEFAULT_PARAMS["num_test"],
    image_size: int = DEFAULT_PARAMS["image_size"],
    seed: int = DEFAULT_PARAMS["seed"],
) -> Path:
    """Generate the shapes dataset under `root` and return `root`.

    Deterministic (same arguments -> byte-identical files) and cached: when `root` already holds
    a complete dataset with the same parameters nothing is done. The dataset is written to a
    sibling temporary directory (named with this process's PID; those of dead processes are
    removed) and renamed into place, so an interrupted run (SIGTERM included: `Terminated`)
    never leaves a partial dataset. Generation holds an exclusive lock on `root`
    (`captioning.locks`): a second process waits, then uses the finished dataset. A `root` that
    holds a shapes dataset of other parameters is replaced; a non-empty `root` that is not a
    shapes dataset raises `FileExistsError`.
    """
    for name, n in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
        if n < 0:
            raise ValueError(f"{name} must be >= 0, got {n}")
    if image_size < 16:
        raise ValueError(f"image_size must be >= 16, got {image_size}")
    root = Path(root)
    params = _params(num_train, num_val, num_test, image_size, seed)
    if is_complete(root, params):
        return root
    _check_replaceable(root)

    root.parent.mkdir(parents=True, exist_ok=True)
    with sigterm_raises(), exclusive_lock(root, what=f"the shapes dataset {root}"):
        if is_complete(root, params):  # generated by another process while this one waited
            log.info("shapes dataset generated by another process: %s", root)
            return root
        _check_replaceable(root)
        _remove_stale_temporaries(root)
        tmp = temporary_name(root)
        log.info("generating shapes dataset (%d/%d/%d images, %dpx, seed %d) in %s",
                 num_train, num_val, num_test, image_size, seed, root)
        try:
            _write_dataset(tmp, params)
            _move_into_place(tmp, root, params)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return root


def _remove_stale_temporaries(root: Path) -> None:
    """Remove the temporary dataset folders beside `root` (new ones being written, old ones
    set aside) of generators that died."""
    for p in root.parent.glob(f".{root.name}.*.tmp"):
        if is_stale(p, name=root.name):
            log.info("removing %s, left by a generator that died", p)
            shutil.rmtree(p, ignore_errors=True)


def _check_replaceable(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise FileExistsError(f"{root} exists and is not a directory")
    if root.is_dir() and any(root.iterdir()) and _read_manifest(root) is None:
        why = (f"its {MANIFEST_FILE} is unreadable, perhaps damaged"
               if (root / MANIFEST_FILE).exists() else f"no {MANIFEST_FILE}")
        raise FileExistsError(
            f"{root} is not empty and is not a shapes dataset ({why}); refusing to overwrite "
            "it: remove the folder to generate the dataset there, or give another root")


def _move_into_place(tmp: Path, root: Path, params: Mapping[str, Any]) -> None:
    trash: Path | None = None
    if root.is_dir():
        if any(root.iterdir()):
            _check_replaceable(root)
            # An older shapes dataset: set aside under a temporary name, then dropped (by the
            # next generation's clean-up if this process dies before it does).
            trash = temporary_name(root)
            os.rename(root, trash)
        else:
            root.rmdir()
    try:
        os.rename(tmp, root)
    except OSError:
        # Another process (e.g. another DDP rank) finished first.
        if not is_complete(root, params):
            raise
    if trash is not None:
        shutil.rmtree(trash, ignore_errors=True)
