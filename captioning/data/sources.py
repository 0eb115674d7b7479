"""Data sources: where the images and captions of a `CaptionDataModule` come from.

One class per source, each with only its own arguments:

* `ShapesSource`: the synthetic shapes dataset, generated on first use.
* `KarpathySplits`: a Karpathy split file (dataset_coco.json, dataset_flickr8k.json,
  dataset_flickr30k.json).
* `CocoCaptions`: raw COCO caption files; missing val/test splits are carved out.
* `JsonlCaptions` (in `captioning.data.tables`, beside its reader): your own images, a folder
  and a captions.jsonl (or .csv) table.

A source reads its records (`read`), prepares its files (`prepare`), says where feature caches
go by default (`cache_root`) and which file a split comes from (`describe`), and gives the
object boxes that ground evaluation (`grounding`, an `ObjectBoxes`), if it has any. In a
LightningCLI config a source is given by class path:

    data:
      source:
        class_path: captioning.data.sources.ShapesSource
        init_args: {root: data/shapes, num_train: 4000}
"""

from __future__ import annotations

import abc
import importlib
import inspect
import logging
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from captioning.data.carving import carve
from captioning.data.problems import DataError, Problem
from captioning.data.readers import (
    ImageRecord,
    OnError,
    Records,
    id_problem,
    load_json,
    read_coco_captions,
    read_karpathy,
    type_name,
)
from captioning.data.shapes import (
    BOXES_FILE,
    COLORS,
    DEFAULT_PARAMS,
    DEFAULT_ROOT,
    SHAPES,
    SIZES,
    SPLIT_FILE,
    generate_shapes,
    parse_objects,
    scene_objects,
)
from captioning.data.transforms import boxes_to_crop_coords

log = logging.getLogger(__name__)

#: Images carved out for each missing COCO val/test split (at most a fifth of the source).
COCO_CARVE_SIZE = 5000


# --------------------------------------------------------------------------------------------
# Object boxes


class ObjectBoxes:
    """The object boxes of a boxes.json, and the words and caption parser that name them.

    `table` is {image_id: [{"color", "shape", "size", "bbox": [x, y, w, h]}, ...]} in pixels of
    the original image; `sizes` is {image_id: (width, height)}. The object vocabulary is the
    shapes dataset's (`object_words`, `color_words`, `modifier_words`, `parse`).
    """

    object_words: tuple[str, ...] = SHAPES
    color_words: tuple[str, ...] = COLORS
    modifier_words: tuple[str, ...] = SIZES

    def __init__(self, table: Mapping[Any, list[dict[str, Any]]],
                 sizes: Mapping[Any, tuple[int, int]], *, path: Path | None = None) -> None:
        self.table: dict[Any, list[dict[str, Any]]] = dict(table)
        self.sizes: dict[Any, tuple[int, int]] = dict(sizes)
        self.path = path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ObjectBoxes:
        """Read a boxes.json ({"images": [{"image_id", "width", "height", "objects"}, ...]});
        a `DataError` naming the file, the entry and the field when it is not one."""
        path = Path(path)
        data = load_json(path)  # a DataError naming the file when it is unreadable
        problems = list(_boxes_problems(str(path), data))
        if problems:
            raise DataError(problems)
        entries = data["images"]
        return cls({e["image_id"]: list(e["objects"]) for e in entries},
                   {e["image_id"]: (e["width"], e["height"]) for e in entries}, path=path)

    @property
    def ids(self) -> tuple[Any, ...]:
        return tuple(self.table)

    def __contains__(self, image_id: object) -> bool:
        return image_id in self.table

    def __len__(self) -> int:
        return len(self.table)

    def objects(self, image_id: Any) -> set[tuple[str, str]]:
        """The (colour, shape) pairs of an image."""
        return scene_objects(self.table[image_id])

    def parse(self, caption: str) -> set[tuple[str, str]]:
        """The (colour, shape) pairs a caption names (`captioning.data.shapes.parse_objects`)."""
        return parse_objects(caption)

    def crop_boxes(self, image_ids: Sequence[Any],
                   size: int | None) -> list[list[dict[str, Any]]]:
        """The objects of `image_ids` with their boxes in normalised [0, 1] xywh of the model
        input of side `size` made by the eval transform (see `boxes_to_crop_coords`)."""
        out = []
        for i in image_ids:
            w, h = self.sizes[i]
            out.append([{**o, "bbox": list(boxes_to_crop_coords(o["bbox"], w, h, size=size))}
                        for o in self.table[i]])
        return out


def _boxes_problems(file: str, data: Any) -> Iterator[Problem]:
    """The problems of a parsed boxes.json (`ObjectBoxes.load`)."""
    images = data.get("images") if isinstance(data, dict) else None
    if not isinstance(images, list):
        yield Problem(file, "(file)", "images", "expected an object with a list 'images'")
        return
    first: dict[Any, int] = {}  # image id -> its first entry
    for i, e in enumerate(images):
        entry = f"images[{i}]"
        if not isinstance(e, dict):
            yield Problem(file, entry, "(entry)", f"expected an object, got {type_name(e)}")
            continue
        why = id_problem(e, "image_id")
        if why is not None:
            yield Problem(file, entry, "image_id", why)
        elif first.setdefault(e["image_id"], i) != i:  # its objects would be lost
            yield Problem(file, entry, "image_id", f"duplicate image id {e['image_id']!r} "
                          f"(first in images[{first[e['image_id']]}])")
        for key in ("width", "height"):
            if not _positive_int(e.get(key)):
                yield Problem(file, entry, key, "missing" if key not in e else
                              f"expected a positive int, got {e[key]!r}")
        objects = e.get("objects")
        if not isinstance(objects, list):
            yield Problem(file, entry, "objects", "missing" if "objects" not in e else
                          f"expected a list, got {type_name(objects)}")
            continue
        for j, o in enumerate(objects):
            yield from _object_problems(file, entry, f"objects[{j}]", o)


def _object_problems(file: str, entry: str, where: str, o: Any) -> Iterator[Problem]:
    if not isinstance(o, dict):
        yield Problem(file, entry, where, f"expected an object, got {type_name(o)}")
        return
    for key in ("color", "shape"):
        if not isinstance(o.get(key), str):
            yield Problem(file, entry, f"{where}.{key}", "missing" if key not in o else
                          f"expected a string, got {type_name(o[key])}")
    box = o.get("bbox")
    if not (isinstance(box, list) and len(box) == 4 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in box)):
        yield Problem(file, entry, f"{where}.bbox", "missing" if "bbox" not in o else
                      f"expected [x, y, w, h] numbers, got {box!r}")


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


# --------------------------------------------------------------------------------------------
# Sources


@dataclass
class SourceRecords:
    """What a source read: records by split, the problems found and what was skipped."""

    splits: dict[str, list[ImageRecord]] = field(
        default_factory=lambda: {"train": [], "val": [], "test": []})
    problems: list[Problem] = field(default_factory=list)
    skipped_images: int = 0
    skipped_captions: int = 0
    carved: tuple[str, ...] = ()  # the splits carved out of the training images (`carve`)

    @classmethod
    def merge(cls, parts: Iterable[Records]) -> SourceRecords:
        """The records of every part by their split, with the problems and skips added up."""
        out = cls()
        for part in parts:
            for r in part:
                out.splits.setdefault(r.split, []).append(r)
            out.skipped_captions += part.skipped_captions
            out.skipped_images += part.skipped_images
            out.problems += part.problems
        return out


#: The folder, beside a source's annotations, that holds its feature caches by default.
CACHE_FOLDER = "features"


class DataSource(abc.ABC):
    """Where images and captions come from. Subclasses take keyword-only constructor arguments
    stored under their own names (`init_args`, equality and `config` rely on it)."""

    #: The data module's `min_word_count` when it is not given.
    default_min_word_count: int = 5
    boxes_path: str | None = None

    @abc.abstractmethod
    def read(self, on_error: OnError = "fail") -> SourceRecords:
        """Read the records of every split (`on_error`: see `captioning.data.readers`)."""

    def prepare(self) -> None:
        """Make the files exist (e.g. generate a synthetic dataset); by default nothing."""
        return None

    @abc.abstractmethod
    def cache_root(self) -> Path:
        """Where feature caches go when the data module has no `cache_dir`: a `CACHE_FOLDER`
        beside the source's annotations."""

    @abc.abstractmethod
    def describe(self, split: str) -> str:
        """The annotation file `split` comes from (for messages)."""

    def grounding(self) -> ObjectBoxes | None:
        """The object boxes of the images, or None when this source has none."""
        path = self._boxes_file()
        return None if path is None else ObjectBoxes.load(path)

    def _boxes_file(self) -> Path | None:
        return Path(self.boxes_path) if self.boxes_path else None

    # ---- plain-data form -------------------------------------------------------------------

    def init_args(self) -> dict[str, Any]:
        """The constructor arguments, as plain data (paths as strings)."""
        names = [p.name for p in inspect.signature(type(self)).parameters.values()
                 if p.kind is inspect.Parameter.KEYWORD_ONLY]
        return {n: _plain(getattr(self, n)) for n in names}

    def config(self) -> dict[str, Any]:
        """{"class_path", "init_args"}: the form a LightningCLI config takes (and JSON/YAML)."""
        cls = type(self)
        return {"class_path": f"{cls.__module__}.{cls.__qualname__}",
                "init_args": self.init_args()}

    @staticmethod
    def from_config(config: Mapping[str, Any]) -> DataSource:
        """The source a `config()` describes."""
        module, _, name = str(config["class_path"]).rpartition(".")
        cls = getattr(importlib.import_module(module), name)
        if not (isinstance(cls, type) and issubclass(cls, DataSource)):
            raise ValueError(f"{config['class_path']} is not a DataSource")
        return cls(**dict(config.get("init_args") or {}))

    def same_data(self, config: Any) -> bool:
        """Whether a saved `config()` reads this source's data: equal, or of this class with
        its training annotations at the same place (however spelled)."""
        if config == self.config():
            return True
        try:
            other = DataSource.from_config(config)
        except (ValueError, TypeError, KeyError, ImportError, AttributeError):
            return False
        same = os.path.realpath(other.describe("train")) == os.path.realpath(self.describe("train"))
        return type(other) is type(self) and same

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DataSource):
            return NotImplemented
        return type(self) is type(other) and self.init_args() == other.init_args()

    def __hash__(self) -> int:
        return hash((type(self), tuple(self.init_args().items())))

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.init_args().items())
        return f"{type(self).__name__}({args})"


def _plain(value: Any) -> Any:
    return str(value) if isinstance(value, os.PathLike) else value


class ShapesSource(DataSource):
    """The synthetic shapes dataset under `root`, generated when missing or generated with other
    parameters (`num_train`, `num_val`, `num_test`, `image_size`, `seed`; see
    `captioning.data.shapes.generate_shapes`). Read from its Karpathy split file; its
    boxes.json grounds evaluation unless `boxes_path` names another file."""

    default_min_word_count = 1

    def __init__(self, *, root: str = DEFAULT_ROOT,
                 num_train: int = DEFAULT_PARAMS["num_train"],
                 num_val: int = DEFAULT_PARAMS["num_val"],
                 num_test: int = DEFAULT_PARAMS["num_test"],
                 image_size: int = DEFAULT_PARAMS["image_size"],
                 seed: int = DEFAULT_PARAMS["seed"], boxes_path: str | None = None) -> None:
        for name, n in (("num_train", num_train), ("num_val", num_val), ("num_test", num_test)):
            if n < 0:
                raise ValueError(f"{name} must be >= 0, got {n}")
        if image_size < 16:
            raise ValueError(f"image_size must be >= 16, got {image_size}")
        self.root = Path(root)
        self.num_train, self.num_val, self.num_test = num_train, num_val, num_test
        self.image_size, self.seed = image_size, seed
        self.boxes_path = boxes_path

    @property
    def params(self) -> dict[str, int]:
        """The generation parameters (`generate_shapes` keyword arguments)."""
        return {"num_train": self.num_train, "num_val": self.num_val,
                "num_test": self.num_test, "image_size": self.image_size, "seed": self.seed}

    def prepare(self) -> None:
        generate_shapes(self.root, **self.params)

    def read(self, on_error: OnError = "fail") -> SourceRecords:
        self.prepare()
        return SourceRecords.merge([read_karpathy(self.root / SPLIT_FILE, self.root,
                                                  merge_restval=True, on_error=on_error)])

    def cache_root(self) -> Path:
        return self.root / CACHE_FOLDER

    def describe(self, split: str) -> str:
        return str(self.root / SPLIT_FILE)

    def grounding(self) -> ObjectBoxes | None:
        self.prepare()  # boxes.json is generated with the dataset
        return super().grounding()

    def _boxes_file(self) -> Path:
        return Path(self.boxes_path) if self.boxes_path else self.root / BOXES_FILE


class KarpathySplits(DataSource):
    """A Karpathy split file `split_file` (dataset_coco.json, dataset_flickr8k.json,
    dataset_flickr30k.json) with images under `image_root` (default: the file's folder).
    "restval" images join the training split when `merge_restval`, else are kept apart (as
    split "restval", which no loader uses). `boxes_path`: a boxes.json that grounds evaluation.
    """

    def __init__(self, *, split_file: str, image_root: str | None = None,
                 merge_restval: bool = True, boxes_path: str | None = None) -> None:
        if not split_file:
            raise ValueError("KarpathySplits needs split_file")
        self.split_file = split_file
        self.image_root = image_root
        self.merge_restval = merge_restval
        self.boxes_path = boxes_path

    def read(self, on_error: OnError = "fail") -> SourceRecords:
        split_file = Path(self.split_file)
        image_root = self.image_root if self.image_root is not None else split_file.parent
        return SourceRecords.merge([read_karpathy(split_file, image_root,
                                                  merge_restval=self.merge_restval,
                                                  on_error=on_error)])

    def cache_root(self) -> Path:
        return Path(self.split_file).parent / CACHE_FOLDER

    def describe(self, split: str) -> str:
        return str(self.split_file)


class CocoCaptions(DataSource):
    """Raw COCO caption files `*_annotations` (captions_train2014.json, ...) with images in
    `*_images`. Missing splits are carved out, `carve_size` images each (at most a fifth of the
    source): test out of val when only `test_annotations` is missing, otherwise the missing val
    (and test) out of train, by each image's id alone (`carve`), so the evaluation splits do not
    change between runs. `boxes_path`: a boxes.json that grounds evaluation.
    """

    def __init__(self, *, train_annotations: str, train_images: str,
                 val_annotations: str | None = None, val_images: str | None = None,
                 test_annotations: str | None = None, test_images: str | None = None,
                 carve_size: int = COCO_CARVE_SIZE, boxes_path: str | None = None) -> None:
        if not (train_annotations and train_images):
            raise ValueError("CocoCaptions needs train_annotations and train_images")
        for split, ann, images in (("val", val_annotations, val_images),
                                   ("test", test_annotations, test_images)):
            if ann is not None and images is None:
                raise ValueError(f"{split}_annotations is set but {split}_images is not")
        self.train_annotations, self.train_images = train_annotations, train_images
        self.val_annotations, self.val_images = val_annotations, val_images
        self.test_annotations, self.test_images = test_annotations, test_images
        self.carve_size = carve_size
        self.boxes_path = boxes_path

    @property
    def files(self) -> dict[str, tuple[str | None, str | None]]:
        """{split: (annotations, images)}."""
        return {"train": (self.train_annotations, self.train_images),
                "val": (self.val_annotations, self.val_images),
                "test": (self.test_annotations, self.test_images)}

    def read(self, on_error: OnError = "fail") -> SourceRecords:
        out = SourceRecords.merge(
            read_coco_captions(ann, images, split=split, on_error=on_error)  # type: ignore[arg-type]
            for split, (ann, images) in self.files.items() if ann is not None)
        out.carved = self._carve_missing(out.splits, out.problems)
        return out

    def _carve_missing(self, by_split: dict[str, list[ImageRecord]],
                       problems: Sequence[Problem] = ()) -> tuple[str, ...]:
        """Carve the missing splits (`carve`); returns those carved out of the training images.
        DataError naming the file of the split carved from, and the first of its entries left
        out as bad (`problems`), when it is too small."""
        if self.test_annotations is not None and self.val_annotations is not None:
            return ()
        if self.val_annotations is None:
            source = "train"
            missing = [s for s in ("val", "test") if self.files[s][0] is None]
        else:
            source, missing = "val", ["test"]
        pool = by_split[source]
        k = min(self.carve_size, len(pool) // 5)
        if k < 1:
            where = self.describe(source)
            bad = [p for p in problems if p.file == where]
            why = f"cannot carve {' and '.join(missing)} out of {len(pool)} {source} images" + (
                f" ({len(bad)} problems left entries out, the first: {bad[0].entry}: field "
                f"'{bad[0].field}': {bad[0].message})" if bad else "")
            raise DataError([Problem(where, "(splits)", "/".join(missing), why)])
        by_split[source], carved = carve(pool, dict.fromkeys(missing, k))
        for split, records in carved.items():
            by_split[split] = [replace(r, split=split) for r in records]
            log.info("carved %d %s images out of %s", len(records), split, source)
        return tuple(missing) if source == "train" else ()  # out of val: no training image

    def cache_root(self) -> Path:
        return Path(self.train_annotations).parent / CACHE_FOLDER

    def describe(self, split: str) -> str:
        return str(self.files[split][0] or self.train_annotations)
