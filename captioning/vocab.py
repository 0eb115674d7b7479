"""Tokenizer and vocabulary.

The tokenizer lowercases and splits on anything that is not a letter, digit, combining mark or
inner apostrophe, in any script: "café" (composed as NFC), "दौड़ता" with its vowel signs, not
"caf" or "द ड त". Chinese and Japanese, written without spaces, are read a character a token
(`CJK`), as character-level captioning does: "一只猫" is "一 只 猫", not one word. It needs no
downloaded data, and the same function builds training targets and references.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import sys
import unicodedata
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

PAD, START, END, UNK = "<pad>", "<start>", "<end>", "<unk>"
SPECIALS: tuple[str, ...] = (PAD, START, END, UNK)


#: Characters of scripts written without spaces between words, each a token where it is a
#: letter (not ・ or ゛): the CJK ideographs (with extension A, the compatibility block and the
#: supplementary planes), the ideographic iteration marks, hiragana and katakana (half-width too).
CJK = ("\u3005-\u3007\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f"
       "\U00020000-\U0002ffff")


@functools.cache
def token_pattern() -> re.Pattern[str]:
    """One `CJK` character, or a word: a letter or digit, then letters, digits and combining
    marks (Indic and Thai vowel signs, accents NFC cannot compose), with inner apostrophes.
    The marks, which a regular expression's word class leaves out, are read from the Unicode
    database once per process (about 0.2 s)."""
    marks: list[list[int]] = []
    last = -2
    for cp in range(sys.maxunicode + 1):
        if unicodedata.category(chr(cp)).startswith("M"):
            if cp != last + 1:
                marks.append([cp, cp])
            marks[-1][1] = last = cp
    part = "".join(re.escape(chr(a)) + ("-" + re.escape(chr(b)) if b > a else "")
                   for a, b in marks)
    letter = rf"(?![{CJK}])[^\W_]"
    char = rf"(?:{letter}|[{part}])"
    return re.compile(rf"(?=[^\W_])[{CJK}]|{letter}{char}*(?:'{char}+)*")


_NON_ASCII = re.compile(r"[^\x00-\x7f]")
_CJK_CHAR = re.compile(rf"[{CJK}]")


def _spaced(match: re.Match[str]) -> str:
    c = match.group()
    if c.isalnum():
        return f" {c} " if _CJK_CHAR.match(c) else c
    return c if unicodedata.category(c).startswith("M") else " "


def space_cjk(text: str) -> str:
    """`text` for coco-caption's PTBTokenizer, whose rules hold for ASCII (its punctuation list
    dropped; `&`, `%`, hyphenated words kept, as in the literature's scores), so that outside
    ASCII it reads `tokenize`'s words: each `CJK` letter spaced apart, and the other characters
    outside ASCII that `tokenize` drops (。、「」・！…) made spaces."""
    if text.isascii():
        return text
    return _NON_ASCII.sub(_spaced, unicodedata.normalize("NFC", text))


#: `token_pattern` on ASCII text, where it has no marks to read and needs no NFC: 2.5x faster.
ASCII_WORD = re.compile(r"[a-zA-Z0-9]+(?:'[a-zA-Z0-9]+)*")


def word_pattern(text: str) -> re.Pattern[str]:
    """The pattern that finds `text`'s words: `ASCII_WORD` for ASCII text, else
    `token_pattern` (the text composed as NFC first)."""
    return ASCII_WORD if text.isascii() else token_pattern()


def tokenize(text: str) -> list[str]:
    """Lowercase word tokens; punctuation is dropped."""
    if not text.isascii():
        text = unicodedata.normalize("NFC", text)
    return word_pattern(text).findall(text.lower())


class Vocabulary:
    """Maps tokens to ids. Ids 0..3 are always pad, start, end and unk."""

    pad_id, start_id, end_id, unk_id = 0, 1, 2, 3

    def __init__(self, words: Sequence[str], *, origin: dict[str, Any] | None = None) -> None:
        words = list(words)
        bad = next((i for i, w in enumerate(words) if not isinstance(w, str)), None)
        if bad is not None:
            raise ValueError(f"vocabulary word {bad} (words[{bad}]) is not a string: "
                             f"{words[bad]!r}")
        if tuple(words[: len(SPECIALS)]) != SPECIALS:
            raise ValueError(f"vocabulary must start with the specials {SPECIALS}, got {words[:4]}")
        if len(set(words)) != len(words):
            raise ValueError("vocabulary has duplicate words")
        self.itos: list[str] = words
        self.stoi: dict[str, int] = {w: i for i, w in enumerate(words)}
        #: What `build` made it from (`vocab_origin`): settings and a digest of the word
        #: counts; None for a vocabulary given as a word list. Not part of `to_dict`: only the
        #: data module's shared file records it (`captioning.data.vocab_file`).
        self.origin = origin

    @classmethod
    def build(
        cls,
        captions: Iterable[Sequence[str]],
        *,
        min_count: int = 1,
        max_size: int | None = None,
    ) -> Vocabulary:
        """Build from tokenised captions; ties in frequency break alphabetically."""
        counts = Counter(tok for caption in captions for tok in caption)
        words = sorted((w for w, c in counts.items() if c >= min_count and w not in SPECIALS),
                       key=lambda w: (-counts[w], w))
        if max_size is not None:
            words = words[: max(0, max_size - len(SPECIALS))]
        return cls([*SPECIALS, *words], origin=vocab_origin(counts, min_count, max_size))

    def __len__(self) -> int:
        return len(self.itos)

    def __contains__(self, word: str) -> bool:
        return word in self.stoi

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Vocabulary) and self.itos == other.itos

    def encode(self, tokens: Sequence[str], *, add_special: bool = True) -> list[int]:
        ids = [self.stoi.get(t, self.unk_id) for t in tokens]
        return [self.start_id, *ids, self.end_id] if add_special else ids

    def decode(self, ids: Iterable[int]) -> list[str]:
        """Tokens up to the first end token, with every special token removed."""
        out: list[str] = []
        for i in ids:
            i = int(i)
            if i == self.end_id:
                break
            if i < len(SPECIALS):
                continue
            out.append(self.itos[i])
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"words": list(self.itos)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Vocabulary:
        if not isinstance(data, dict) or not isinstance(data.get("words"), list):
            raise ValueError("vocabulary data must be a dict with a list under 'words'")
        return cls(data["words"])

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict()))

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, RecursionError) as e:
            raise ValueError(f"{path}: not valid JSON: {e}") from e
        try:
            return cls.from_dict(data)
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from e


def vocab_origin(counts: Mapping[str, int], min_count: int, max_size: int | None) -> dict[str, Any]:
    """What a vocabulary is built from: its settings, and a digest of the word counts (the
    training captions, as far as the vocabulary can tell them apart)."""
    digest = hashlib.sha256()
    for word, n in sorted(counts.items()):
        digest.update(f"{word}\t{n}\n".encode())
    return {"min_count": min_count, "max_size": max_size, "counts": digest.hexdigest()[:16]}


def origin_differences(saved: dict[str, Any], wanted: dict[str, Any]) -> dict[str, str]:
    """{field: what differs} between a saved vocabulary's origin and the one wanted now."""
    return {key: ("built from other training captions" if key == "counts" else
                  f"built with {saved.get(key)!r}, this run's is {value!r}")
            for key, value in wanted.items() if saved.get(key) != value}
