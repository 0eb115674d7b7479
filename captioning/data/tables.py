"""Your own images: a folder of images and a caption table (captions.jsonl or .csv), read by
`read_captions_table` and served to the data module by the `JsonlCaptions` source:

    data:
      source:
        class_path: captioning.data.tables.JsonlCaptions
        init_args: {root: my_images, val_size: 0.1, test_size: 0.1}

`read_captions_table(file, image_root)` reads one JSON object a line (blank lines are skipped)

    {"image": "dogs/1.jpg", "caption": "A dog runs on the grass.", "split": "train"}

or, for a file ending in .csv, the same columns under the header row `image,caption,split`
(read with the `csv` module). An image has one line per caption. `split` ("train", "val" or
"test") is optional but all or nothing: every line gives it or none does, and the lines of one
image agree on it; without it every record is "train" (`JsonlCaptions` carves val and test out).
Image paths are relative to `image_root` and stay inside it (no absolute path, no ".."); an
image's id is its path as written, normalised ("a/./b.jpg" is "a/b.jpg"), so ids are strings.

Problems name the file, the line and the field, e.g. `captions.jsonl: line 7: field 'caption':
caption is empty or whitespace`; `on_error` works as in `captioning.data.readers`: "fail"
raises `DataError` listing them, "skip" drops the bad lines (an image whose lines disagree on
the split is dropped whole) and counts them. A file that cannot be read, is not UTF-8, has a
CSV header without image and caption columns, or holds no line at all always raises.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import IO, Any

from captioning.data.carving import carve
from captioning.data.problems import DataError, Problem, read_problem
from captioning.data.readers import (
    DATA_SPLITS,
    ImageRecord,
    OnError,
    Records,
    Report,
    caption_problem,
    check_policy,
    type_name,
)
from captioning.data.sources import CACHE_FOLDER, DataSource, SourceRecords

log = logging.getLogger(__name__)

#: File name endings and the format each one means.
TABLE_FORMATS: dict[str, str] = {".jsonl": "jsonl", ".csv": "csv"}

Row = tuple[int, Any, tuple[str, str] | None]  # (line number, row, (field, problem) or None)


@dataclass(frozen=True)
class _Line:
    number: int
    image: str  # normalised relative path: the image id
    caption: str
    split: str | None


def table_format(file: str | os.PathLike[str]) -> str:
    """"jsonl" or "csv", by the file name's ending; ValueError for any other."""
    fmt = TABLE_FORMATS.get(Path(file).suffix.lower())
    if fmt is None:
        raise ValueError(f"a caption table is a .jsonl or .csv file, got {os.fspath(file)!r}")
    return fmt


def _jsonl_rows(f: IO[str]) -> Iterator[Row]:
    for n, text in enumerate(f, start=1):
        if not text.strip():
            continue
        try:
            row = json.loads(text)
        except json.JSONDecodeError as e:
            yield n, None, ("(json)", f"malformed JSON: {e.msg} (column {e.colno})")
            continue
        except RecursionError:
            yield n, None, ("(json)", "JSON nested too deeply to read")
            continue
        if not isinstance(row, dict):
            yield n, None, ("(entry)", f"expected a JSON object, got {type_name(row)}")
        else:
            yield n, row, None


def _csv_rows(f: IO[str], file: Path) -> Iterator[Row]:
    reader = csv.DictReader(f)
    try:
        header = reader.fieldnames or []
        if header and not {"image", "caption"} <= set(header):
            raise DataError([Problem(str(file), "line 1", "(header)",
                                     "expected the columns image,caption[,split], got "
                                     + ",".join(header))])
        for row in reader:  # blank rows are skipped by the csv module
            if None in row:  # more cells than the header has columns
                yield reader.line_num, None, ("(entry)", f"{len(header) + len(row[None])} "
                                              f"cells, the header has {len(header)}")
            else:
                yield reader.line_num, {k: v for k, v in row.items() if v is not None and
                                        not (k == "split" and v == "")}, None  # "": no split
    except csv.Error as e:
        raise DataError([Problem(str(file), f"line {reader.line_num}", "(csv)",
                                 f"malformed CSV: {e}")]) from e


def _rows(file: Path) -> list[Row]:
    """Every non-blank line of the table; a DataError naming the file when it cannot be read."""
    fmt = table_format(file)
    try:
        with open(file, encoding="utf-8-sig", newline="") as f:  # -sig: a BOM (Excel's CSV)
            return list(_csv_rows(f, file) if fmt == "csv" else _jsonl_rows(f))
    except OSError as e:
        raise DataError([read_problem(file, e)]) from None
    except UnicodeDecodeError as e:
        raise DataError([Problem(str(file), "(file)", "(encoding)",
                                 f"not UTF-8 text: {e.reason}")]) from e


def _image_path(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """(normalised relative path, None), or (None, why `row["image"]` is not one)."""
    value = row.get("image")
    if not isinstance(value, str):
        return None, "missing" if "image" not in row else \
            f"expected a string, got {type_name(value)}"
    path = PurePosixPath(value)
    if not value.strip() or path.as_posix() == ".":
        return None, f"expected a relative image path, got {value!r}"
    if path.is_absolute() or value.startswith("\\"):
        return None, f"absolute path {value!r}: image paths are relative to the image folder"
    if ".." in path.parts or ".." in PureWindowsPath(value).parts:
        return None, f"path {value!r} escapes the image folder ('..')"
    return path.as_posix(), None


def _split(row: dict[str, Any]) -> tuple[str | None, str | None]:
    """(split or None when the row gives none, None), or (None, why the split is bad)."""
    if "split" not in row:
        return None, None
    value = row["split"]
    if value in DATA_SPLITS:
        return value, None
    return None, f"unknown split {value!r} (expected one of {', '.join(DATA_SPLITS)})"


def _line(report: Report, n: int, row: dict[str, Any]) -> _Line | None:
    """The caption line `n`, or None when it is skipped (its problems go to `report`)."""
    entry, before = f"line {n}", len(report.problems)
    image, why = _image_path(row)
    report.add(entry, "image", why)
    caption = row.get("caption")
    report.add(entry, "caption", "missing" if "caption" not in row else caption_problem(caption))
    split, why = _split(row)
    report.add(entry, "split", why)
    if len(report.problems) > before:
        report.skipped_captions += 1
        return None
    return _Line(n, image, caption.strip(), split)  # type: ignore[arg-type, union-attr]


def _all_or_none(report: Report, lines: list[_Line]) -> list[_Line]:
    """The lines, or when some give a split and others do not, those of the larger group (the
    others are problems: a table gives the split on every line or on none)."""
    given = [ln for ln in lines if ln.split is not None]
    if not given or len(given) == len(lines):
        return lines
    odd = [ln for ln in lines if ln.split is None]
    why = f"missing, but {len(given)} other lines give a split (all lines or none)"
    if len(given) < len(odd):
        odd, why = given, f"given, but {len(odd)} other lines give none (all lines or none)"
    for ln in odd:
        report.add(f"line {ln.number}", "split", why)
        report.skipped_captions += 1
    dropped = {ln.number for ln in odd}
    return [ln for ln in lines if ln.number not in dropped]


def _records(report: Report, lines: Iterable[_Line], root: str) -> list[ImageRecord]:
    """One record per image, in the order of their first lines; an image whose lines disagree
    on the split is a problem per disagreeing line and is dropped."""
    first: dict[str, _Line] = {}
    captions: dict[str, list[str]] = {}
    disputed: set[str] = set()
    for ln in lines:
        head = first.setdefault(ln.image, ln)
        if ln.split != head.split:
            report.add(f"line {ln.number}", "split",
                       f"image {ln.image!r} is in {ln.split!r} here but in {head.split!r} on "
                       f"line {head.number} (all lines of an image give one split)")
            disputed.add(ln.image)
        captions.setdefault(ln.image, []).append(ln.caption)
    report.skipped_images += len(disputed)
    return [ImageRecord(image, Path(os.path.join(root, image)), head.split or "train",
                        tuple(captions[image]))
            for image, head in first.items() if image not in disputed]


def read_captions_table(
    file: str | os.PathLike[str],
    image_root: str | os.PathLike[str],
    *,
    on_error: OnError = "fail",
) -> Records:
    """Read a caption table (captions.jsonl or .csv, see the module docstring).

    Image path = image_root / image; image id = the normalised relative path (a string);
    captions are stripped and keep the file's order; split = the table's, else "train".
    """
    check_policy(on_error)
    file = Path(file)
    report = Report(str(file))
    rows = _rows(file)
    if not rows:
        raise DataError([Problem(str(file), "(file)", "(file)", "no caption lines")])
    lines: list[_Line] = []
    for n, row, problem in rows:
        if problem is not None:
            report.add(f"line {n}", *problem)
            report.skipped_captions += 1
        elif (line := _line(report, n, row)) is not None:
            lines.append(line)
    records = _records(report, _all_or_none(report, lines), str(image_root))
    return report.finish(records, on_error)


def _carve_count(name: str, size: Any, n_images: int) -> int:
    """The images `size` asks for out of `n_images`: a count (int >= 1) as it is, a fraction
    (float in (0, 1)) of `n_images` rounded, at least 1; ValueError naming `name` otherwise."""
    if isinstance(size, int) and not isinstance(size, bool) and size >= 1:
        return size
    if isinstance(size, float) and 0 < size < 1:
        return max(1, round(size * n_images))
    raise ValueError(f"{name} must be an image count (an int >= 1) or a fraction of the "
                     f"images (a float between 0 and 1), got {size!r}")


class JsonlCaptions(DataSource):
    """Your own images: the folder `root` and a caption table `captions` (relative to `root`,
    or absolute): captions.jsonl, one {"image", "caption", "split"} object a line, or a .csv
    with those columns (`captioning.data.tables`). Image paths are relative to `root`; image ids
    are those paths. Val and test, when the table gives none of their images (every image, when
    it has no split column), are carved out of the training images, whole images (every
    caption of an image stays in its split): `val_size` and `test_size` images, each a count
    (int >= 1) or a fraction of all the table's images (float in (0, 1)). Carving goes by each
    image's path alone (`carve`): the same table gives the same splits, whatever the data
    module's seed, and a line added or dropped moves at most that many images between splits.
    Feature caches go to `root`/features.
    """

    def __init__(self, *, root: str, captions: str = "captions.jsonl",
                 val_size: int | float = 0.1, test_size: int | float = 0.1) -> None:
        if not root:
            raise ValueError("JsonlCaptions needs root (the image folder)")
        table_format(captions)  # .jsonl or .csv
        _carve_count("val_size", val_size, 1)
        _carve_count("test_size", test_size, 1)
        if isinstance(val_size, float) and isinstance(test_size, float) and \
                val_size + test_size >= 1:
            raise ValueError(f"val_size + test_size must be below 1, got {val_size + test_size}")
        self.root, self.captions = root, captions
        self.val_size, self.test_size = val_size, test_size

    @property
    def table(self) -> Path:
        """The caption table's path."""
        return Path(self.root) / self.captions

    def read(self, on_error: OnError = "fail") -> SourceRecords:
        out = SourceRecords.merge([read_captions_table(self.table, self.root,
                                                       on_error=on_error)])
        missing = [s for s in ("val", "test") if not out.splits[s]]
        if missing:
            self._carve(out.splits, missing)
            out.carved = tuple(missing)
        return out

    def _carve(self, by_split: dict[str, list[ImageRecord]], missing: list[str]) -> None:
        n = sum(len(v) for v in by_split.values())
        sizes = {s: _carve_count(f"{s}_size", getattr(self, f"{s}_size"), n) for s in missing}
        pool = by_split["train"]
        if sum(sizes.values()) >= len(pool):
            want = " and ".join(f"{k} {s}" for s, k in sizes.items())
            raise ValueError(f"{self.table}: cannot carve {want} images out of {len(pool)} "
                             "training images (lower val_size / test_size)")
        by_split["train"], carved = carve(pool, sizes)
        for split, records in carved.items():
            by_split[split] = [dataclasses.replace(r, split=split) for r in records]
            log.info("carved %d %s images out of the %s training images", len(records), split,
                     self.table)

    def cache_root(self) -> Path:
        return Path(self.root) / CACHE_FOLDER

    def describe(self, split: str) -> str:
        return str(self.table)
