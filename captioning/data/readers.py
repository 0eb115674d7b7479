"""Readers for caption annotation files.

* `read_karpathy`: the Karpathy split files (dataset_coco.json, dataset_flickr8k.json,
  dataset_flickr30k.json and the shapes dataset's dataset_shapes.json).
* `read_coco_captions`: raw COCO caption annotations (captions_train2014.json, ...).
* `read_references`: either kind, told apart by its contents (`captioning score`).

Both return `Records`, a list of `ImageRecord` that also carries the problems found and what was
skipped. Bad input is reported as `Problem(file, entry, field, message)`; with
`on_error="fail"` (the default) any problem raises `DataError` listing the first ten; with
`on_error="skip"` bad captions and bad image entries are dropped and counted. Malformed JSON and a
wrong top-level structure always raise. The work per caption is one `tokenize` call, so a
COCO-size Karpathy file (123k images, 616k captions) reads in seconds. Caption tables
(captions.jsonl / .csv) are read by `captioning.data.tables`, with the same `Report`.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from captioning.choices import check_choice
from captioning.data.problems import (
    DataError,
    Problem,
    in_file_order,
    read_problem,
)
from captioning.vocab import word_pattern


def has_tokens(text: str) -> bool:
    """`tokenize(text) != []` without building the list (the tokenizer's own pattern)."""
    return word_pattern(text).search(text) is not None  # letters of either case


OnError = Literal["fail", "skip"]
SPLITS: tuple[str, ...] = ("train", "restval", "val", "test")
#: The splits a data module serves (a Karpathy file's restval merged into train, or left out).
DATA_SPLITS: tuple[str, ...] = ("train", "val", "test")
_SPLIT_NAMES = frozenset(SPLITS)


@dataclass(frozen=True)
class ImageRecord:
    """One image and its raw reference captions."""

    image_id: int | str
    path: Path
    split: str  # "train" | "val" | "test" ("restval" when not merged into train)
    captions: tuple[str, ...]


class Records(list[ImageRecord]):
    """A list of `ImageRecord` plus the problems found while reading and the skip counts."""

    def __init__(
        self,
        records: Iterable[ImageRecord] = (),
        *,
        problems: Iterable[Problem] = (),
        skipped_images: int = 0,
        skipped_captions: int = 0,
    ) -> None:
        super().__init__(records)
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.skipped_images = skipped_images
        self.skipped_captions = skipped_captions


def check_policy(on_error: str) -> None:
    check_choice("on_error", on_error, OnError)


class Report:
    """The problems found in one file, and how many image entries and captions were skipped."""

    def __init__(self, fname: str) -> None:
        self.fname = fname
        self.problems: list[Problem] = []
        self.skipped_images = 0
        self.skipped_captions = 0

    def add(self, entry: str, field: str, message: str | None) -> None:
        """Record a problem of `entry`'s `field`; a None `message` means there is none."""
        if message is not None:
            self.problems.append(Problem(self.fname, entry, field, message))

    def objects(self, items: list, name: str, *,
                captions: bool = False) -> Iterator[tuple[int, dict]]:
        """(index, entry) for the entries of the list `name` that are JSON objects; every other
        entry is a problem and a skipped image entry (a skipped caption with `captions`)."""
        for i, item in enumerate(items):
            if isinstance(item, dict):
                yield i, item
                continue
            self.add(f"{name}[{i}]", "(entry)", f"expected an object, got {type_name(item)}")
            if captions:
                self.skipped_captions += 1
            else:
                self.skipped_images += 1

    def finish(self, records: list[ImageRecord], on_error: str) -> Records:
        self.problems = in_file_order(self.problems)
        if self.problems and on_error == "fail":
            raise DataError(self.problems)
        return Records(records, problems=self.problems, skipped_images=self.skipped_images,
                       skipped_captions=self.skipped_captions)


def type_name(value: Any) -> str:
    """The JSON-ish name of a value's type, for messages ("null", "int", "list", ...)."""
    return "null" if value is None else type(value).__name__


def load_json(file: Path, object_hook: Callable[[dict], Any] | None = None) -> Any:
    """Parse a JSON file; every failure is a DataError naming the file (and line/column)."""
    try:
        with open(file, encoding="utf-8-sig") as f:  # a BOM (Windows editors) is no error
            return json.load(f, object_hook=object_hook)
    except OSError as e:
        raise DataError([read_problem(file, e)]) from None
    except json.JSONDecodeError as e:
        raise DataError([Problem(str(file), f"line {e.lineno} column {e.colno}", "(json)",
                                 f"malformed JSON: {e.msg}")]) from e
    except UnicodeDecodeError as e:
        raise DataError([Problem(str(file), f"byte {e.start}", "(encoding)",
                                 f"not UTF-8 text: {e.reason}")]) from e
    except RecursionError:
        raise DataError([Problem(str(file), "(file)", "(json)",
                                 "JSON nested too deeply to read")]) from None


def _top_list(data: Any, file: Path, key: str) -> list:
    if not isinstance(data, dict):
        raise DataError([Problem(str(file), "(top level)", key,
                                 f"expected a JSON object with a '{key}' list, got "
                                 f"{type_name(data)}")])
    value = data.get(key)
    if not isinstance(value, list):
        what = "missing" if key not in data else f"expected a list, got {type_name(value)}"
        raise DataError([Problem(str(file), "(top level)", key, what)])
    return value


def _valid_id(value: Any) -> bool:
    return (isinstance(value, int) and not isinstance(value, bool)) or (
        isinstance(value, str) and value != "")


def id_problem(item: dict, key: str) -> str | None:
    """Why `item[key]` is not a usable image id, or None when it is fine."""
    if key not in item:
        return "missing image id"
    if not _valid_id(item[key]):
        return f"expected an int or non-empty string, got {type_name(item[key])}"
    return None


def _name_problem(item: dict, key: str) -> str | None:
    """Why `item[key]` is not a usable file name (a non-empty string), or None."""
    value = item.get(key)
    if isinstance(value, str) and value:
        return None
    return "missing" if key not in item else f"expected a non-empty string, got {value!r}"


def caption_problem(raw: Any) -> str | None:
    """Why a raw caption is unusable, or None when it is fine."""
    if not isinstance(raw, str):
        return f"expected a string, got {type_name(raw)}"
    if not raw.strip():
        return "caption is empty or whitespace"
    if not has_tokens(raw):  # == not tokenize(raw), ~4x cheaper at COCO scale
        return f"caption has no word tokens: {raw!r}"
    return None


def _drop_tokens(d: dict) -> dict:
    # Karpathy sentences carry both "raw" and "tokens"; we re-tokenise "raw" ourselves, so the
    # token lists are freed as soon as they are parsed (keeps a COCO-size file well under 2 GB).
    if "raw" in d and "tokens" in d:
        del d["tokens"]
    return d


def _karpathy_sentence(sent: Any, j: int) -> tuple[Any, str, str | None]:
    """(raw caption, field, problem) of the Karpathy sentence entry sentences[j]; the problem is
    None when the caption is usable."""
    if not isinstance(sent, dict):
        return None, f"sentences[{j}]", f"expected an object, got {type_name(sent)}"
    raw = sent.get("raw")
    if raw is None and isinstance(sent.get("tokens"), list) and all(
            isinstance(t, str) for t in sent["tokens"]):
        raw = " ".join(sent["tokens"])  # no "raw": fall back to the tokens
    why = "missing" if raw is None and "raw" not in sent else caption_problem(raw)
    return raw, f"sentences[{j}].raw", why


def _karpathy_image(report: Report, i: int, item: dict, seen: dict[Any, int], *, root: str,
                    merge_restval: bool) -> ImageRecord | None:
    """The record of the Karpathy image entry images[i], or None when it is skipped (its
    problems go to `report`). `seen` maps the image ids met so far to their index."""
    id_field = "cocoid" if "cocoid" in item else "imgid"
    image_id = item.get(id_field)
    entry = f"images[{i}] (id {image_id!r})"
    n_before = len(report.problems)

    why = id_problem(item, id_field)
    if why is not None:
        report.add(entry, id_field if id_field in item else "cocoid/imgid", why)
    elif image_id in seen:
        report.add(entry, id_field, f"duplicate image id (first at images[{seen[image_id]}])")
    else:
        seen[image_id] = i

    filename = item.get("filename")
    report.add(entry, "filename", _name_problem(item, "filename"))
    filepath = item.get("filepath", "")
    if not isinstance(filepath, str):
        report.add(entry, "filepath", f"expected a string, got {type_name(filepath)}")
    split = item.get("split")
    if "split" in item and not isinstance(split, str):
        report.add(entry, "split", f"expected a string, got {type_name(split)}")
    elif split not in _SPLIT_NAMES:
        report.add(entry, "split", "missing" if "split" not in item else
                   f"unknown split {split!r} (expected one of {SPLITS})")
    sentences = item.get("sentences")
    if not isinstance(sentences, list):
        report.add(entry, "sentences", "missing" if "sentences" not in item else
                   f"expected a list, got {type_name(sentences)}")
    if len(report.problems) > n_before:
        report.skipped_images += 1
        return None

    captions: list[str] = []
    for j, sent in enumerate(sentences):
        raw, field, why = _karpathy_sentence(sent, j)
        if why is None:
            captions.append(raw.strip())
        else:
            report.add(entry, field, why)
            report.skipped_captions += 1
    if not captions:
        report.add(entry, "sentences", "no usable captions")
        report.skipped_images += 1
        return None
    if split == "restval" and merge_restval:
        split = "train"
    return ImageRecord(image_id, Path(os.path.join(root, filepath, filename)), split,
                       tuple(captions))


def read_karpathy(
    split_file: str | os.PathLike[str],
    image_root: str | os.PathLike[str],
    *,
    merge_restval: bool = True,
    on_error: OnError = "fail",
) -> Records:
    """Read a Karpathy split file. Image path = image_root / filepath / filename.

    `filepath` is optional (absent in the Flickr files); the image id is `cocoid` when present,
    else `imgid`. "restval" images become "train" when `merge_restval`, else stay "restval".
    """
    check_policy(on_error)
    file = Path(split_file)
    return _karpathy_records(load_json(file, _drop_tokens), file, str(image_root),
                             merge_restval=merge_restval, on_error=on_error)


def _karpathy_records(data: Any, file: Path, root: str, *, merge_restval: bool,
                      on_error: OnError) -> Records:
    report = Report(str(file))
    images = _top_list(data, file, "images")
    records: list[ImageRecord] = []
    seen: dict[Any, int] = {}
    for i, item in report.objects(images, "images"):
        record = _karpathy_image(report, i, item, seen, root=root, merge_restval=merge_restval)
        if record is not None:
            records.append(record)
    return report.finish(records, on_error)


def _coco_image(report: Report, i: int, item: dict, index_of: dict[Any, int],
                bad_ids: set[Any]) -> tuple[int, Any, str] | None:
    """(i, id, file_name) of the COCO image entry images[i], or None when it is rejected (its
    problems go to `report`). Records the id in `index_of`, or in `bad_ids` when rejected."""
    image_id = item.get("id")
    entry = f"images[{i}] (id {image_id!r})"
    n_before = len(report.problems)
    why = id_problem(item, "id")
    if why is not None:
        report.add(entry, "id", why)
    elif image_id in index_of or image_id in bad_ids:
        first = index_of.get(image_id)
        where = f" (first at images[{first}])" if first is not None else ""
        report.add(entry, "id", f"duplicate image id{where}")
    file_name = item.get("file_name")
    report.add(entry, "file_name", _name_problem(item, "file_name"))
    if len(report.problems) > n_before:
        report.skipped_images += 1
        if _valid_id(image_id):
            bad_ids.add(image_id)
        return None
    index_of[image_id] = i
    return i, image_id, file_name


def _coco_annotation(ann: dict, captions: dict[Any, list[str]],
                     bad_ids: set[Any]) -> tuple[Any, str, str | None]:
    """(raw caption, field, problem) of a COCO annotation entry; the problem is None when the
    caption is usable and its image (a key of `captions`) was accepted."""
    image_id = ann.get("image_id")
    if "image_id" not in ann:
        return None, "image_id", "missing"
    if not _valid_id(image_id):
        return None, "image_id", f"expected an int or string, got {type_name(image_id)}"
    if image_id not in captions:
        return None, "image_id", ("refers to an image entry that was rejected"
                                  if image_id in bad_ids else "no image with this id in 'images'")
    raw = ann.get("caption")
    return raw, "caption", "missing" if "caption" not in ann else caption_problem(raw)


def read_coco_captions(
    annotations_file: str | os.PathLike[str],
    image_dir: str | os.PathLike[str],
    *,
    split: str,
    on_error: OnError = "fail",
) -> Records:
    """Read a raw COCO captions file ({"images": [...], "annotations": [...]}).

    Every record gets `split`; path = image_dir / file_name; captions keep the file's order.
    """
    check_policy(on_error)
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    file = Path(annotations_file)
    return _coco_records(load_json(file), file, str(image_dir), split=split, on_error=on_error)


def _coco_records(data: Any, file: Path, root: str, *, split: str, on_error: OnError) -> Records:
    report = Report(str(file))
    images = _top_list(data, file, "images")
    annotations = _top_list(data, file, "annotations")

    entries: list[tuple[int, Any, str]] = []  # (index, id, file_name) of good image entries
    index_of: dict[Any, int] = {}
    bad_ids: set[Any] = set()
    for i, item in report.objects(images, "images"):
        good = _coco_image(report, i, item, index_of, bad_ids)
        if good is not None:
            entries.append(good)

    captions: dict[Any, list[str]] = {image_id: [] for _, image_id, _ in entries}
    for j, ann in report.objects(annotations, "annotations", captions=True):
        image_id = ann.get("image_id")
        raw, field, why = _coco_annotation(ann, captions, bad_ids)
        if why is None:
            captions[image_id].append(raw.strip())
        else:
            report.add(f"annotations[{j}] (id {ann.get('id')!r}, image_id {image_id!r})",
                       field, why)
            report.skipped_captions += 1

    records: list[ImageRecord] = []
    for i, image_id, file_name in entries:
        caps = captions[image_id]
        if not caps:
            report.add(f"images[{i}] (id {image_id!r})", "annotations",
                       "image has no usable captions")
            report.skipped_images += 1
            continue
        records.append(ImageRecord(image_id, Path(os.path.join(root, file_name)), split,
                                   tuple(caps)))

    return report.finish(records, on_error)


def read_references(file: str | os.PathLike[str], *, on_error: OnError = "fail"
                    ) -> tuple[Records, Literal["karpathy", "coco"]]:
    """The images and reference captions of a Karpathy split file or of a raw COCO captions
    file (told apart by its `annotations` list; its images get the split "test"), parsed once,
    and which kind it is. Paths are the files' own names, under no folder."""
    check_policy(on_error)
    path = Path(file)
    data = load_json(path, _drop_tokens)
    if isinstance(data, dict) and "annotations" in data:
        return _coco_records(data, path, "", split="test", on_error=on_error), "coco"
    return _karpathy_records(data, path, "", merge_restval=True, on_error=on_error), "karpathy"


def split_overlaps(by_split: dict[str, list[ImageRecord]],
                   describe: Callable[[str], str]) -> list[Problem]:
    """One Problem per image file listed in two splits (by resolved path, whatever its ids):
    a test or val image that is also a training image would leak into training. `describe`
    names the file a split was read from."""
    first: dict[Path, ImageRecord] = {}
    problems = []
    for split in sorted(by_split, key=lambda s: (s != "train", s)):
        for r in by_split[split]:
            key = Path(r.path).resolve()
            seen = first.setdefault(key, r)
            if seen is not r and seen.split != r.split:
                problems.append(Problem(
                    describe(r.split), f"image id {r.image_id} ({r.split})", "image",
                    f"{r.path} is also in the {seen.split} split as image id {seen.image_id} "
                    f"({describe(seen.split)}); an image belongs to one split"))
    return problems
