"""A defect in input data, and how it is reported: `Problem(file, entry, field, message)`, and
`DataError`, which lists the first `MAX_LISTED` of them in one message; a run lists them all in
its run folder (`PROBLEMS_FILE`, `save_problems`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from captioning.atomic import write_text_atomic

#: How many problems a DataError message lists.
MAX_LISTED = 10
#: In a run folder: every problem of the data the run's command read (failed on, or skipped).
PROBLEMS_FILE = "data_problems.txt"


@dataclass(frozen=True)
class Problem:
    """One defect in an input file: which file, which entry, which field, and what is wrong."""

    file: str
    entry: str  # e.g. "images[12] (id 391895)"
    field: str  # e.g. "sentences[2].raw"
    message: str

    def __str__(self) -> str:
        return f"{self.file}: {self.entry}: field '{self.field}': {self.message}"


class DataError(ValueError):
    """Bad input data. `problems` holds every problem found; the message lists the first ten."""

    def __init__(self, problems: Iterable[Problem], *, listed_in: Path | None = None,
                 skipped: Iterable[Problem] = ()) -> None:
        self.problems: tuple[Problem, ...] = tuple(problems)
        self.listed_in = listed_in  # the file that lists them all (`save_problems`)
        self.skipped: tuple[Problem, ...] = tuple(skipped)  # what on_bad_data: skip left out
        n = len(self.problems)
        if n == 1:
            msg = str(self.problems[0])
        else:
            lines = [f"  {p}" for p in self.problems[:MAX_LISTED]]
            if n > MAX_LISTED:
                lines.append(f"  ... and {n - MAX_LISTED} more"
                             + (f" (all {n} in {listed_in})" if listed_in else ""))
            msg = f"{n} problems in the data:\n" + "\n".join(lines)
        super().__init__(msg)


_SECTION = re.compile(r"# [0-9]+ problems in the data \(([a-z]+): ")


def save_problems(folder: str | Path, stage: str, problems: Sequence[Problem],
                  what: str) -> Path | None:
    """`stage`'s section of `folder`'s `PROBLEMS_FILE`: every one of `problems` (what they did
    to the run: `what`), one a line as a `DataError` lists them, under a `# N problems in the
    data (STAGE: WHAT)` line; none removes the section. Other stages' sections are kept (a clean
    `test` leaves the skipped training images of `fit` listed); the file goes with its last
    section. Written atomically; returns the file's path, or None when it is gone."""
    file = Path(folder) / PROBLEMS_FILE
    sections: dict[str, list[str]] = {}
    try:
        current: list[str] | None = None
        for line in file.read_text(encoding="utf-8").splitlines():
            head = _SECTION.match(line)
            if head:
                current = sections.setdefault(head.group(1), [])
            if current is not None:  # lines before any header: not a list this writes
                current.append(line)
    except FileNotFoundError:
        pass
    except (OSError, UnicodeDecodeError):  # unreadable: replaced by this stage's list
        sections = {}
    sections.pop(stage, None)
    if problems:
        sections[stage] = [f"# {len(problems)} problems in the data ({stage}: {what})",
                           *map(str, problems)]
    if not sections:
        file.unlink(missing_ok=True)
        return None
    text = "".join("\n".join(lines) + "\n" for _, lines in sorted(
        sections.items(), key=lambda kv: (STAGE_ORDER.index(kv[0])
                                          if kv[0] in STAGE_ORDER else len(STAGE_ORDER))))
    return write_text_atomic(file, text)


#: The order of `save_problems`' sections.
STAGE_ORDER = ("fit", "validate", "test", "predict")


def in_file_order(problems: Sequence[Problem]) -> list[Problem]:
    """One file's `problems` in its order: "line 9" before "line 10", "images[2]" before
    "images[10]"; kinds of entry ("images[...]", "annotations[...]") stay in the order they
    were found, and problems of one entry in theirs."""
    def kind(entry: str) -> str:  # "images" of "images[12] (id 391895)", "line " of "line 3"
        return re.split(r"[\[0-9]", entry, maxsplit=1)[0]

    kinds: dict[str, int] = {}
    for p in problems:
        kinds.setdefault(kind(p.entry), len(kinds))
    return sorted(problems, key=lambda p: (kinds[kind(p.entry)],
                                           [int(n) for n in re.findall(r"[0-9]+", p.entry)]))


MISSING = "file does not exist"


def naming_settings(problems: Iterable[Problem], settings: Mapping[str, Any]) -> list[Problem]:
    """`problems` where a missing file comes from one of a source's `settings` (its init_args:
    the file itself, or a folder that holds it) say which setting to change."""
    out = []
    for p in problems:
        key = None
        if p.entry == "(file)" and p.message == MISSING:
            paths = {k: Path(v) for k, v in settings.items() if isinstance(v, str) and v}
            file = Path(p.file)
            key = next((k for k, v in paths.items() if v == file), None) or next(
                (k for k, v in paths.items() if v in file.parents), None)
        out.append(p if key is None else replace(
            p, message=f"{p.message} (data.source.{key} is {settings[key]!r}: pass "
                       f"--data.source.{key} with the right path)"))
    return out


def read_problem(file: Path, error: OSError) -> Problem:
    """Why a file cannot be read: missing, a folder, or what the OS said (permissions, a
    symlink loop, an I/O error)."""
    why = (MISSING if isinstance(error, FileNotFoundError) else
           "is a directory" if isinstance(error, IsADirectoryError) else
           f"cannot read file ({error.strerror or error})")
    return Problem(str(file), "(file)", "(file)", why)
