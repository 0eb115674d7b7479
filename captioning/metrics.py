"""Caption metrics: COCO scores (BLEU, METEOR, ROUGE-L, CIDEr, optional SPICE) and object
accuracy on the synthetic shapes data (attention pointing accuracy: `captioning.pointing`).

`coco_scores` runs pycocoevalcap (coco-caption) unchanged: its Java PTBTokenizer on the raw
references and hypotheses, then its scorers. Java is required (the tokenizer and METEOR are Java
programs): without it `coco_scores` raises `RuntimeError` rather than report partial results.
SPICE also needs the Stanford CoreNLP 3.6.0 jars, which pycocoevalcap downloads on first use;
when they are missing (no internet here) SPICE is skipped with the warning
"SPICE unavailable: <reason>" and the other metrics are still returned.

The module imports neither torch nor the shapes data module at import time.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import shutil
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from captioning.vocab import SPECIALS, space_cjk

log = logging.getLogger(__name__)

COCO_METRICS: tuple[str, ...] = (
    "BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr",
)
METEOR_TIMEOUT_S = 600.0  # the METEOR JVM is killed when it does not answer within this time

_SPECIAL_RE = re.compile("|".join(re.escape(s) for s in SPECIALS))
_SPICE_CORENLP_JARS = ("stanford-corenlp-3.6.0.jar", "stanford-corenlp-3.6.0-models.jar")


# --------------------------------------------------------------------------- helpers


def strip_special_tokens(text: str) -> str:
    """Remove `<start>`, `<end>`, `<pad>`, `<unk>` and squeeze whitespace."""
    return " ".join(_SPECIAL_RE.sub(" ", text).split())


def _as_text(value: Any, *, what: str, key: Hashable) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, Sequence) and all(isinstance(t, str) for t in value):
        return " ".join(value)  # a list of tokens
    raise TypeError(f"{what} for id {key!r} must be a string, got {type(value).__name__}")


def _check_keys(a: Mapping, b: Mapping, a_name: str, b_name: str) -> None:
    ka, kb = set(a), set(b)
    if ka != kb:
        only_a, only_b = sorted(map(repr, ka - kb))[:5], sorted(map(repr, kb - ka))[:5]
        raise ValueError(
            f"{a_name} and {b_name} must have the same ids: {len(ka - kb)} only in {a_name} "
            f"(e.g. {', '.join(only_a) or '-'}), {len(kb - ka)} only in {b_name} "
            f"(e.g. {', '.join(only_b) or '-'})"
        )
    if not ka:
        raise ValueError(f"{a_name} and {b_name} are empty")


class _Captured:
    text = ""


@contextlib.contextmanager
def _captured_output() -> Iterator[_Captured]:
    """Capture Python-level stdout/stderr and the OS file descriptors 1 and 2.

    The scorers print (BLEU) and their Java children write to the inherited descriptors
    (the PTBTokenizer reports on stderr, SPICE on both); none of it should reach users.
    Descriptor redirection is process-wide for the duration of the block.
    """
    captured = _Captured()
    buf = io.StringIO()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    saved: list[tuple[int, int]] = []
    with tempfile.TemporaryFile() as tmp:
        for fd in (1, 2):
            try:
                saved.append((fd, os.dup(fd)))
                os.dup2(tmp.fileno(), fd)
            except OSError:  # no such descriptor (embedded interpreters): Python level only
                pass
        try:
            with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
                yield captured
        finally:
            for fd, dup in saved:
                os.dup2(dup, fd)
                os.close(dup)
            tmp.seek(0)
            captured.text = buf.getvalue() + tmp.read().decode(errors="replace")


def _log_captured(name: str, text: str, level: int = logging.DEBUG) -> None:
    text = text.strip()
    if text:
        log.log(level, "%s output:\n%s", name, text)


def _ptb_tokenize(captions: Mapping[Hashable, list[str]]) -> dict[Hashable, list[str]]:
    """pycocoevalcap's PTBTokenizer (its jar, command and punctuation list), with its input file
    in the temporary folder ($TMPDIR) instead of inside site-packages, removed whatever happens
    (SIGTERM included); empty strings are kept as "" and never sent to Java."""
    import subprocess

    from pycocoevalcap.tokenizer import ptbtokenizer as ptb

    ids = [k for k, caps in captions.items() for c in caps if c.strip()]
    lines = [c.replace("\n", " ") for caps in captions.values() for c in caps if c.strip()]
    tokenized: list[str] = []
    if lines:
        jar = Path(ptb.__file__).resolve().parent / ptb.STANFORD_CORENLP_3_4_1_JAR
        with tempfile.TemporaryDirectory(prefix="captioning-ptb-") as tmp:
            text = Path(tmp) / "captions.txt"
            text.write_text("\n".join(lines), encoding="utf-8")
            out = subprocess.run(["java", "-cp", str(jar), "edu.stanford.nlp.process.PTBTokenizer",
                                  "-preserveLines", "-lowerCase", str(text)],
                                 capture_output=True, check=True).stdout.decode()
        tokenized = [" ".join(w for w in ln.rstrip().split(" ") if w not in ptb.PUNCTUATIONS)
                     for ln in out.split("\n")]
    done: dict[Hashable, list[str]] = {}
    for k, t in zip(ids, tokenized):
        done.setdefault(k, []).append(t)
    out_caps: dict[Hashable, list[str]] = {}
    for k, caps in captions.items():
        toks = iter(done.get(k, []))
        out_caps[k] = [next(toks) if c.strip() else "" for c in caps]
    return out_caps


def close_meteor(meteor: Any) -> None:
    """Stop the METEOR JVM now (pycocoevalcap only does it in __del__)."""
    proc = meteor.meteor_p
    for stream in (proc.stdin, proc.stdout, proc.stderr):
        with contextlib.suppress(Exception):
            stream.close()
    with contextlib.suppress(Exception):
        proc.kill()
    with contextlib.suppress(Exception):
        proc.wait(timeout=30)
    # its __del__ takes this lock; a fresh one keeps __del__ from blocking if scoring failed
    meteor.lock = threading.Lock()


def _meteor_score(
    gts: dict[Hashable, list[str]], res: dict[Hashable, list[str]], *, timeout: float
) -> float:
    from pycocoevalcap.meteor.meteor import Meteor

    meteor = Meteor()
    timed_out = threading.Event()

    def kill() -> None:
        timed_out.set()
        meteor.meteor_p.kill()

    watchdog = threading.Timer(timeout, kill)
    watchdog.daemon = True
    watchdog.start()
    try:
        score, _ = meteor.compute_score(gts, res)
    except (ValueError, OSError) as e:
        if timed_out.is_set():
            raise RuntimeError(f"METEOR did not answer within {timeout:g} s; killed it") from e
        raise RuntimeError(f"METEOR failed: {e}") from e
    finally:
        watchdog.cancel()
        close_meteor(meteor)
    return float(score)


# --------------------------------------------------------------------------- SPICE


def spice_dir_path() -> Path | None:
    """pycocoevalcap's SPICE folder (where its jars go), or None without pycocoevalcap."""
    import importlib.util

    try:
        spec = importlib.util.find_spec("pycocoevalcap.spice.spice")
    except ImportError:  # pycocoevalcap itself is missing
        return None
    if spec is None or spec.origin is None:
        return None
    return Path(spec.origin).resolve().parent


def spice_available() -> tuple[bool, str]:
    """Whether SPICE can run offline, and why not.

    pycocoevalcap's SPICE runs `java -jar spice-1.0.jar` in its `spice/` folder; the jar needs
    `spice/lib/stanford-corenlp-3.6.0.jar` and `...-models.jar`, which pycocoevalcap would
    download (from nlp.stanford.edu) on first use when the first is missing.
    """
    if shutil.which("java") is None:
        return False, "no java executable on PATH"
    spice_dir = spice_dir_path()
    if spice_dir is None:
        return False, "pycocoevalcap is not installed"
    jar = spice_dir / "spice-1.0.jar"
    if not jar.is_file():
        return False, f"{jar} is missing"
    missing = [n for n in _SPICE_CORENLP_JARS if not (spice_dir / "lib" / n).is_file()]
    if missing:
        return False, (
            f"Stanford CoreNLP 3.6.0 jars missing from {spice_dir / 'lib'}: {', '.join(missing)} "
            "(pycocoevalcap downloads them from nlp.stanford.edu on first use; put "
            "stanford-corenlp-3.6.0.jar and stanford-corenlp-3.6.0-models.jar from "
            "stanford-corenlp-full-2015-12-09.zip there to enable SPICE)"
        )
    return True, "ok"


def _spice_score(gts: dict[Hashable, list[str]], res: dict[Hashable, list[str]]) -> float | None:
    ok, reason = spice_available()
    if not ok:
        log.warning("SPICE unavailable: %s", reason)
        return None
    from pycocoevalcap.spice.spice import Spice

    out = _Captured()
    try:
        with _captured_output() as out:
            score, _ = Spice().compute_score(gts, res)
    except Exception as e:  # a failed Java run, unreadable output, ...
        _log_captured("SPICE", out.text, logging.WARNING)
        log.warning("SPICE unavailable: the SPICE run failed: %s", e)
        return None
    _log_captured("SPICE", out.text)
    return float(score)


# --------------------------------------------------------------------------- COCO scores


def _coco_scorers() -> tuple[type, type, type]:
    """pycocoevalcap's (Bleu, Rouge, Cider) scorer classes; RuntimeError when Java (which the
    PTBTokenizer and METEOR need) or pycocoevalcap is missing."""
    if shutil.which("java") is None:
        raise RuntimeError(
            "coco_scores needs a Java runtime (pycocoevalcap's PTBTokenizer and METEOR are Java "
            "programs) but no 'java' is on PATH; install a JRE (e.g. openjdk-17-jre-headless)"
        )
    try:
        from pycocoevalcap.bleu.bleu import Bleu
        from pycocoevalcap.cider.cider import Cider
        from pycocoevalcap.rouge.rouge import Rouge
    except ImportError as e:
        raise RuntimeError(f"coco_scores needs pycocoevalcap: {e}") from e
    return Bleu, Rouge, Cider


def _clean_captions(
    references: Mapping[Any, Sequence[str]], hypotheses: Mapping[Any, str]
) -> tuple[dict[Hashable, list[str]], dict[Hashable, list[str]]]:
    """(refs, hyps) as {id: [caption, ...]} strings without special tokens, Chinese and
    Japanese characters spaced apart (`space_cjk`, as `tokenize` reads them), ready for the
    PTBTokenizer; ValueError for an id without references."""
    refs: dict[Hashable, list[str]] = {}
    hyps: dict[Hashable, list[str]] = {}
    for key in references:
        r = references[key]
        if isinstance(r, str) or not r:
            raise ValueError(f"references for id {key!r} must be a non-empty list of strings")
        refs[key] = [space_cjk(strip_special_tokens(_as_text(c, what="reference", key=key)))
                     for c in r]
        hyps[key] = [space_cjk(strip_special_tokens(
            _as_text(hypotheses[key], what="hypothesis", key=key)))]
    return refs, hyps


def coco_scores(
    references: Mapping[Any, Sequence[str]],
    hypotheses: Mapping[Any, str],
    *,
    spice: bool = False,
    meteor_timeout: float = METEOR_TIMEOUT_S,
    per_image_cider: dict[Any, float] | None = None,
) -> dict[str, float]:
    """Corpus-level coco-caption scores of `hypotheses` (one caption per id) against
    `references` (raw reference captions per id); both dicts must have the same ids.

    Returns "BLEU-1".."BLEU-4", "METEOR", "ROUGE-L" as fractions in [0, 1], "CIDEr" (CIDEr-D,
    unscaled) and, when `spice=True` and SPICE can run, "SPICE" (otherwise a warning
    "SPICE unavailable: <reason>" is logged and the key is absent).

    Special tokens (`<start>`, `<end>`, `<pad>`, `<unk>`) are removed from hypotheses and
    references before tokenising. Empty hypotheses are allowed (they score zero). A hypothesis
    may also be given as a list of tokens. The scorers' console output is captured and logged
    at DEBUG. METEOR runs in a JVM that is always shut down before returning; it is killed if
    it does not answer within `meteor_timeout` seconds (then RuntimeError).

    `per_image_cider`, when given, is filled with each image's CIDEr-D.

    Raises ValueError on mismatched ids or an id without references, RuntimeError when Java is
    missing (the PTBTokenizer and METEOR need it) or METEOR fails.
    """
    _check_keys(references, hypotheses, "references", "hypotheses")
    Bleu, Rouge, Cider = _coco_scorers()
    refs, hyps = _clean_captions(references, hypotheses)

    out = _Captured()
    try:
        with _captured_output() as out:
            gts, res = _ptb_tokenize(refs), _ptb_tokenize(hyps)
            bleu, _ = Bleu(4).compute_score(gts, res, verbose=0)
            rouge, _ = Rouge().compute_score(gts, res)
            cider, per_image = Cider().compute_score(gts, res)
            meteor = _meteor_score(gts, res, timeout=meteor_timeout)
    except Exception:
        _log_captured("coco-caption", out.text, logging.WARNING)
        raise
    _log_captured("coco-caption", out.text)

    if per_image_cider is not None:  # pycocoevalcap scores the ids in gts' order
        per_image_cider.update((k, float(v)) for k, v in zip(gts, per_image))
    scores = {f"BLEU-{n + 1}": float(b) for n, b in enumerate(bleu)}
    scores.update({"METEOR": meteor, "ROUGE-L": float(rouge), "CIDEr": float(cider)})
    if spice:
        s = _spice_score(gts, res)
        if s is not None:
            scores["SPICE"] = s
    log.debug("coco scores on %d images: %s", len(refs), scores)
    return scores


# --------------------------------------------------------------------------- objects


def _default_parse() -> Callable[[str], set[tuple[str, str]]]:
    from captioning.data.shapes import parse_objects

    return parse_objects


def objects_correct(
    hypotheses: Mapping[Any, str],
    objects: Mapping[Any, Collection[tuple[str, str]]],
    *,
    parse: Callable[[str], set[tuple[str, str]]] | None = None,
) -> float:
    """Share of images whose caption names exactly the true set of (colour, shape) pairs.

    `parse` defaults to `captioning.data.shapes.parse_objects`. Both dicts must have the same
    ids. Special tokens are removed before parsing.
    """
    _check_keys(objects, hypotheses, "objects", "hypotheses")
    parse = parse or _default_parse()
    good = sum(
        set(parse(strip_special_tokens(_as_text(hypotheses[k], what="hypothesis", key=k))))
        == {tuple(o) for o in objects[k]}
        for k in objects
    )
    return good / len(objects)
