"""`captioning score RESULTS.json --references FILE [--split test]`: the coco-caption scores of
a results file (BLEU-1..4, METEOR, ROUGE-L, CIDEr-D; SPICE with `--spice`), computed as `test`
computes them (`captioning.metrics.coco_scores`), so that captions from any source, another
codebase's included, are scored as the literature's tables are (arctic-captions'
evaluate_coco.py).

RESULTS is a JSON list of `{"image_id": ID, "caption": TEXT}` (the COCO results format: `test`
writes it as `test_captions.json`; other keys are ignored) or of `{"file_name": PATH, "caption":
TEXT}` (what `captioning predict` writes; an image is then found by its file name; `image_id`
wins where an entry has both). FILE is a Karpathy split file (dataset_coco.json,
dataset_flickr8k.json, dataset_flickr30k.json), a raw COCO captions file (captions_val2014.json)
or a caption table (captions.jsonl / .csv: image ids are its relative paths). Each image of
RESULTS is scored against its references, as coco-caption scores the images of a results file;
with `--split` every image must be of that split, and a warning says how many of the split's
images RESULTS leaves out. An entry that names no image, an image captioned twice or a caption
that is not text is a problem; all of them are listed at once, each naming the file, the entry
and the field. As in `test`, the special tokens (`<unk>`, ...) are removed before scoring.

Prints one `METRIC VALUE` line per score (`--json`: one JSON object); `--out FILE` also writes
the scores as JSON. Exit status: 0 scored, 1 bad input (or Java missing), 2 bad arguments.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from captioning.commands.errors import ConfigError, error
from captioning.data.problems import DataError, Problem
from captioning.data.readers import (
    SPLITS,
    ImageRecord,
    OnError,
    Records,
    id_problem,
    load_json,
    read_references,
    type_name,
)
from captioning.data.tables import TABLE_FORMATS, read_captions_table

log = logging.getLogger(__name__)

KEYS = ("image_id", "file_name")  # how a results entry names its image


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="captioning score",
        description="Score a results JSON (image_id or file_name, caption) against the "
                    "references of a Karpathy split file or a COCO captions file with the "
                    "coco-caption metrics.")
    p.add_argument("results", help="a JSON list of {image_id|file_name, caption}")
    p.add_argument("--references", required=True, metavar="FILE",
                   help="a Karpathy split file (dataset_coco.json, ...), a COCO captions "
                        "file (captions_val2014.json) or a caption table (.jsonl, .csv)")
    p.add_argument("--split", choices=[s for s in SPLITS if s != "restval"], default=None,
                   help="every image must be of this split of a Karpathy file (restval counts "
                        "as train); a warning says how many of its images have no caption")
    p.add_argument("--on-bad-data", choices=("fail", "skip"), default="fail",
                   help="bad entries of the references file: stop (default), or leave them out "
                        "with a warning (as a run with data.on_bad_data: skip did)")
    p.add_argument("--spice", action="store_true", help="also SPICE (needs the CoreNLP jars)")
    p.add_argument("--eval-references", type=int, default=None, metavar="N",
                   help="score against each image's first N references (as data.eval_references; "
                        "the authors' reference files hold 5); default: all")
    p.add_argument("--json", action="store_true", help="print the scores as one JSON object")
    p.add_argument("--out", default=None, help="also write the scores to this JSON file")
    return p


def common_tail(a: Sequence[str], b: Sequence[str]) -> int:
    """How many trailing parts two paths' `parts` share."""
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


class Index:
    """The reference images of a file, found by id or by file name."""

    def __init__(self, records: Sequence[ImageRecord]) -> None:
        self.by_id = {r.image_id: r for r in records}
        self.by_name: dict[str, list[ImageRecord]] = {}
        for r in records:
            self.by_name.setdefault(Path(r.path).name, []).append(r)

    def find(self, key: str, value: Any) -> tuple[ImageRecord | None, str | None]:
        """(the record, None), or (None, why not); `key`: "image_id" or "file_name"."""
        if key == "image_id":
            found = self.by_id.get(value)
            return found, None if found else "no image with this id in the references" + \
                self._id_hint(value)
        if not isinstance(value, str) or not value:
            return None, f"expected a non-empty string, got {type_name(value)}"
        named = self.by_name.get(Path(value).name, [])
        if len(named) > 1:  # the one whose path ends with more of the name's folders
            depth = [common_tail(Path(r.path).parts, Path(value).parts) for r in named]
            best = [r for r, d in zip(named, depth) if d == max(depth)]
            if len(best) == 1:
                return best[0], None
            ids = ", ".join(repr(r.image_id) for r in best)
            return None, (f"names {len(best)} reference images (ids {ids}): give image_id, or "
                          "a path with their folders")
        return (named[0], None) if named else (None, "no image of this name in the references")

    def _id_hint(self, value: Any) -> str:
        """The reference id that `value` spells with another type ("391895" for 391895)."""
        other = str(value) if isinstance(value, int) else (
            int(value) if isinstance(value, str) and value.strip().isdigit() else None)
        if other is None or other not in self.by_id:
            return ""
        return f" (the references have the {type_name(other)} id {other!r})"


def _entry_problem(entry: Any) -> tuple[str | None, str, str | None]:
    """(the key naming the image: image_id where given, else file_name; field, problem) of a
    results entry."""
    if not isinstance(entry, dict):
        return None, "(entry)", f"expected an object, got {type_name(entry)}"
    key = next((k for k in KEYS if k in entry), None)
    if key is None:
        return None, "image_id", "missing (or file_name)"
    if key == "image_id" and (why := id_problem(entry, key)) is not None:
        return None, key, why
    caption = entry.get("caption")
    if not isinstance(caption, str):
        return key, "caption", ("missing" if "caption" not in entry else
                                f"expected a string, got {type_name(caption)}")
    return key, "caption", None


def match_results(results: str | Path, records: Sequence[ImageRecord], *,
                  split: str | None = None) -> tuple[dict[Any, list[str]], dict[Any, str]]:
    """(references, hypotheses) by image id for the entries of the results file `results`;
    raises DataError listing every entry that names no image (of `split`), names one twice
    or has no text caption."""
    results = Path(results)
    entries = load_json(results)
    if not isinstance(entries, list):
        raise DataError([Problem(str(results), "(file)", "(top level)",
                                 f"expected a list of results, got {type_name(entries)}")])
    index, problems = Index(records), []
    hypotheses: dict[Any, str] = {}
    first: dict[Any, int] = {}
    for i, entry in enumerate(entries):
        key, field, why = _entry_problem(entry)
        named = next((k for k in KEYS if isinstance(entry, dict) and k in entry), None)
        name = f"[{i}]" if named is None else f"[{i}] ({named} {entry[named]!r})"
        record = None
        if why is None:
            record, why = index.find(key, entry[key])
            field = key
        if record is not None and split is not None and record.split != split:
            why = f"image {record.image_id!r} is in the {record.split} split, not {split}"
        elif record is not None and record.image_id in first:
            why = f"image {record.image_id!r} again (first at [{first[record.image_id]}])"
        if why is not None:
            problems.append(Problem(str(results), name, field, why))
            continue
        first[record.image_id] = i
        hypotheses[record.image_id] = entry["caption"]
    if problems:
        raise DataError(problems)
    if not hypotheses:
        raise DataError([Problem(str(results), "(file)", "(top level)", "no results to score")])
    return {i: list(index.by_id[i].captions) for i in hypotheses}, hypotheses


def reference_records(file: str | Path, on_error: OnError = "fail") -> tuple[Records, str]:
    """The records of a references file, and its kind: "karpathy", "coco" or "table"."""
    if Path(file).suffix.lower() in TABLE_FORMATS:
        return read_captions_table(file, "", on_error=on_error), "table"
    return read_references(file, on_error=on_error)


def score(results: str | Path, references: str | Path, *, split: str | None = None,
          spice: bool = False, on_bad_data: OnError = "fail",
          eval_references: int | None = None) -> dict[str, float]:
    """The coco-caption scores of a results file against a references file (see the module),
    each image's first `eval_references` references (None: all)."""
    from captioning.metrics import coco_scores

    records, kind = reference_records(references, on_bad_data)
    if records.problems:
        log.warning("left out %d bad entries of %s (first: %s)", len(records.problems),
                    references, records.problems[0])
    if split is not None and kind == "coco":
        raise ConfigError(f"--split: {references} is a COCO captions file, which holds one "
                          "split; drop --split")
    refs, hyps = match_results(results, records, split=split)
    pool = [r for r in records if split is None or r.split == split]
    if len(hyps) < len(pool) and split is not None:
        log.warning("%d of the %d %s images of %s have no caption in %s: scored the %s",
                    len(pool) - len(hyps), len(pool), split, references, results,
                    "one that does" if len(hyps) == 1 else f"{len(hyps)} that do")
    log.info("scoring %s of %s against %s", _count(len(hyps), "image"), results, references)
    refs = {i: r[:eval_references] for i, r in refs.items()}
    return coco_scores(refs, hyps, spice=spice)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    from captioning.atomic import write_json_atomic

    try:
        a = _parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:  # --help or a usage error (argparse printed the message)
        return int(e.code) if isinstance(e.code, int) else 2
    try:
        if a.eval_references is not None and a.eval_references < 1:
            raise ConfigError(f"--eval-references must be >= 1, got {a.eval_references}")
        scores = score(a.results, a.references, split=a.split, spice=a.spice,
                       on_bad_data=a.on_bad_data, eval_references=a.eval_references)
    except RuntimeError as e:  # Java missing, or METEOR failed (`coco_scores`)
        error(str(e))
        return 1
    if a.out:
        write_json_atomic(Path(a.out), scores, indent=2)
    text = json.dumps(scores) + "\n" if a.json else "".join(
        f"{name:<8} {value:.4f}\n" for name, value in scores.items())
    sys.stdout.write(text)
    sys.stdout.flush()
    return 0
