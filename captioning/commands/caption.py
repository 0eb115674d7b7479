"""`captioning caption --checkpoint CKPT IMAGE|DIR|GLOB ...`: caption images with a checkpoint.

Prints one `path<TAB>caption` line per image (or one JSON object per line with --json) on
stdout; with `--num-captions N` (the N best beams, or N samples with `--sample`) a line per
caption, or one JSON object per image with a `captions` list. Problems go to stderr, one line
each. Exit status: 0 all captioned, 1 some inputs failed, 2 nothing to caption or an unusable
checkpoint / device. Torch is imported only after the arguments are parsed, and Lightning,
W&B, NLTK and pycocoevalcap never are.
"""

from __future__ import annotations

import argparse
import glob
import json
import logging
import os
import sys
import time
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from captioning.commands.errors import error

if TYPE_CHECKING:  # imported at run time only inside the command (fast start)
    import torch

    from captioning.checkpoint import LoadedModel
    from captioning.models.captioner import DecodeConfig

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".gif", ".tif", ".tiff", ".webp"})
_GLOB_CHARS = frozenset("*?[")


@dataclass
class Inputs:
    """Expanded inputs: image paths in order, and one message per input that gave none."""

    paths: list[Path]
    problems: list[str]


def _is_image_name(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def _images_in(folder: Path) -> list[Path]:
    return sorted((p for p in folder.iterdir() if p.is_file() and _is_image_name(p)),
                  key=lambda p: p.name)


def expand_arg(arg: str) -> tuple[list[Path], str | None]:
    """One input's image paths in order, or the problem it gives: a file as given (kept
    whatever its extension: the loader reports non-images), a directory's images (sorted; not
    its sub-folders', which `DIR/**` gives), a glob pattern's matching images and
    directories' images."""
    p = Path(arg)
    if "\0" in arg:  # the OS cannot name such a file: one line, not a ValueError
        return [], f"{arg!r}: not a usable path (it contains a NUL byte)"
    if p.is_dir():
        try:
            found = _images_in(p)
        except OSError as e:
            return [], f"{arg}: cannot read the folder ({e.strerror or e})"
        if found:
            return found, None
        deeper = any(q.is_file() and _is_image_name(q) for q in p.rglob("*"))  # to the first
        hint = f"; its sub-folders have some: pass '{p / '**'}' (quoted) for those" \
            if deeper else ""
        return [], f"{arg}: directory has no images ({', '.join(sorted(IMAGE_EXTENSIONS))}){hint}"
    if p.exists() or not _GLOB_CHARS & set(arg):
        return [p], None  # missing or non-image files are reported by the loader
    found = []
    for m in map(Path, sorted(glob.glob(arg, recursive=True))):
        if m.is_dir():
            found += _images_in(m)
        elif m.is_file() and _is_image_name(m):
            found.append(m)
    return found, None if found else f"{arg}: pattern matched no images"


def resolved(path: Path) -> Path:
    """`path` resolved; a symlink loop (which the loader reports) as it is, made absolute."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):  # RuntimeError before Python 3.13
        return path.absolute()


def each_file_once(paths: Iterable[Path]) -> list[Path]:
    """Each file once, at its first occurrence (paths compared `resolved`)."""
    seen: set[Path] = set()
    kept = []
    for p in paths:
        key = resolved(p)
        if key not in seen:
            seen.add(key)
            kept.append(p)
    return kept


def expand_inputs(args: Sequence[str]) -> Inputs:
    """`expand_arg` over the arguments; a path is listed once, at its first occurrence."""
    paths: list[Path] = []
    problems: list[str] = []
    for arg in args:
        found, problem = expand_arg(arg)
        paths += found
        problems += [problem] if problem else []
    return Inputs(each_file_once(paths), problems)


def overlay_names(paths: Sequence[Path], folder: Path | None = None) -> list[str]:
    """One distinct PNG file name per image: its stem, with -2, -3, ... on repeats and where
    the name is that of an input in `folder` (the overlays' folder), which it would replace:
    the input's own name, and a symlink's target's where that lies there."""
    here = resolved(folder) if folder is not None else None
    used: set[str] = set()
    for p in paths if here is not None else ():
        if resolved(p.absolute().parent) == here:  # the input (or the link) itself
            used.add(p.name.lower())
        if resolved(p).parent == here:  # the file it reads
            used.add(resolved(p).name.lower())
    names = []
    for p in paths:
        stem, n = p.stem or "image", 1
        name = f"{stem}.png"
        while name.lower() in used:
            n += 1
            name = f"{stem}-{n}.png"
        used.add(name.lower())
        names.append(name)
    return names


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="captioning caption",
        description="Caption images with a trained checkpoint (beam search, or sampling).")
    p.add_argument("inputs", nargs="*", metavar="IMAGE|DIR|GLOB",
                   help="image files, folders of images or glob patterns (quote them)")
    p.add_argument("--checkpoint", required=True,
                   help="a checkpoint file or an exported model folder (captioning export)")
    add_decoding_flags(p, captions_help="captions per image: the N best beams (N <= beam size) "
                                        "or N samples")
    p.add_argument("--batch-size", type=int, default=32, help="images decoded together")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto uses the GPU when there is one")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per line: path, caption, score, tokens")
    p.add_argument("--overlay", "--overlays", dest="overlay", metavar="DIR", default=None,
                   help="write one attention strip PNG per image into DIR")
    return p


def add_decoding_flags(p: argparse.ArgumentParser, *, captions_help: str) -> None:
    """The decoding flags that `caption` and `predict` share, read by `decoding_settings`:
    `--beam-size`, `--max-len`, `--sample`, `--temperature`, `--num-captions` (its help
    `captions_help`) and `--fast-beam` (`Captioner.use_fast_beam`)."""
    p.add_argument("--beam-size", type=int, default=None,
                   help="beam width (default: the checkpoint's decoding setting)")
    p.add_argument("--max-len", type=int, default=None,
                   help="most words per caption (default: the checkpoint's setting)")
    p.add_argument("--sample", action="store_true",
                   help="draw each word from softmax(logits / temperature) instead of a beam")
    p.add_argument("--temperature", type=float, default=None,
                   help="sampling temperature, > 0 (default: the checkpoint's, 1.0)")
    p.add_argument("--num-captions", type=int, default=1, help=captions_help)
    p.add_argument("--fast-beam", choices=("auto", "off", "fixed", "compile", "graphs"),
                   default="auto",
                   help="beam search over fixed shapes, the same captions: fixed, compiled, "
                        "or replayed as CUDA graphs (the same --batch-size for every batch "
                        "replays one); auto: graphs on CUDA, off elsewhere")


def output_problem(path: str | Path, *, folder: bool) -> str | None:
    """Why `path` cannot be made (a folder with `folder`, else a file's folder): a file where
    a folder is needed, on its way; None when nothing stands in the way."""
    target = Path(path) if folder else Path(path).parent
    for p in (target, *target.parents):
        if p.exists():
            return None if p.is_dir() else f"{p} is a file, not a folder"
    return None


def _checked_inputs(a: argparse.Namespace) -> Inputs | None:
    """The expanded inputs, or None after reporting why there is nothing to caption."""
    for name in ("beam_size", "max_len", "batch_size", "num_captions"):
        value = getattr(a, name)
        if value is not None and value < 1:
            error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
            return None
    if a.overlay and (why := output_problem(a.overlay, folder=True)):
        error(f"--overlay {a.overlay}: {why}")
        return None
    if not a.inputs:
        error("no inputs: give image files, folders or glob patterns")
        return None
    inputs = expand_inputs(a.inputs)
    if not inputs.paths:
        for msg in inputs.problems:
            error(msg)
        error("no images to caption")
        return None
    return inputs


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    try:
        a = _parser().parse_args(argv)
    except SystemExit as e:  # --help or a usage error (argparse printed the message)
        return int(e.code) if isinstance(e.code, int) else 2
    inputs = _checked_inputs(a)
    if inputs is None:
        return 2

    import torch

    from captioning.checkpoint import CheckpointError, load_checkpoint

    if a.device == "cuda" and not torch.cuda.is_available():
        error("--device cuda: no CUDA device is available")
        return 2
    device = torch.device("cuda" if a.device != "cpu" and torch.cuda.is_available() else "cpu")
    try:
        model = load_checkpoint(a.checkpoint, map_location="cpu")
    except CheckpointError as e:
        error(str(e))
        return 2
    try:
        settings = decoding_settings(model.decode, a)
    except ValueError as e:
        error(str(e))
        return 2
    model.captioner.to(device)
    model.captioner.use_fast_beam(a.fast_beam)
    for msg in inputs.problems:
        error(msg)
    start = time.perf_counter()
    done, failed = _caption_all(a, model, inputs.paths, device, settings)
    if done < 0:
        return 1
    failed += len(inputs.problems)
    log.info("captioned %d image(s) in %.1f s on %s%s", done, time.perf_counter() - start,
             device, f", {failed} failed" if failed else "")
    return 1 if failed else 0


def _caption_all(a: argparse.Namespace, model: LoadedModel, paths: list[Path],
                 device: torch.device, settings: DecodeConfig) -> tuple[int, int]:
    """Caption `paths` batch by batch, printing as it goes: (captioned, failed); captioned is
    -1 when stdout went away."""
    failed = done = 0
    out_dir = Path(a.overlay) if a.overlay else None
    names = overlay_names(paths, out_dir) if out_dir else []
    if out_dir is not None and out_dir.is_dir():
        from captioning.atomic import remove_stale_temporaries

        remove_stale_temporaries(out_dir)  # of a killed run's strips
    for batch in _batches(paths, model.config.image_size, a.batch_size):
        for _path, reason in batch.failures:
            error(reason)
        failed += len(batch.failures)
        if not batch.paths:
            continue
        records, pred = _caption_batch(model, batch, device, settings)
        if out_dir is not None:
            failed += _write_overlays(model, batch, pred, records, device,
                                      [out_dir / names[i] for i in batch.indices])
        lines = [json.dumps(rec, ensure_ascii=False) for rec in records] if a.json else [
            f"{rec['path']}\t{c['caption']}" for rec in records
            for c in rec.get("captions", [rec])]
        try:
            sys.stdout.write("".join(ln + "\n" for ln in lines))
            sys.stdout.flush()
        except BrokenPipeError:  # the reader went away (e.g. `| head`): stop quietly
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115  # no flush error at exit
            return -1, failed
        done += len(batch.paths)
    return done, failed


def decoding_settings(decode: DecodeConfig, flags: argparse.Namespace) -> DecodeConfig:
    """The checkpoint's decoding settings `decode`, overridden by the `add_decoding_flags` in
    `flags`: `--beam-size` / `--max-len` (None keeps the checkpoint's); a beam search (`caption`
    and `predict` decode alike) keeping the `--num-captions` best, or with `--sample` that many
    samples per image at `--temperature`. Raises ValueError, naming the option, for settings
    that do not go together.

    A checkpoint evaluated greedily defaults to beam 1, which is the same search."""
    from dataclasses import replace

    beam_size, max_len, sample = flags.beam_size, flags.max_len, flags.sample
    temperature, num_captions = flags.temperature, flags.num_captions
    if temperature is not None and not (sample and temperature > 0):
        raise ValueError(f"--temperature must be > 0, with --sample (got {temperature}"
                         f"{'' if sample else ' without --sample'})")
    max_len = max_len or decode.max_len
    if sample:
        return replace(decode, strategy="sample", max_len=max_len, num_captions=num_captions,
                       temperature=temperature or decode.temperature)
    beam = beam_size or (1 if decode.strategy == "greedy" else decode.beam_size)
    if num_captions > beam:
        raise ValueError(f"--num-captions {num_captions} is more than the beam size {beam}: "
                         "raise --beam-size, or --sample")
    return replace(decode, strategy="beam", beam_size=beam, max_len=max_len,
                   num_captions=num_captions)


@dataclass
class _Batch:
    indices: list[int]  # positions in the expanded input list
    paths: list[Path]
    images: torch.Tensor | None  # (B, 3, S, S) normalised, None when every image failed
    failures: list[tuple[Path, str]]


def _batches(paths: Sequence[Path], image_size: int, batch_size: int) -> Iterator[_Batch]:
    """Load images with the project's loader and transform, `batch_size` good ones at a time."""
    import torch

    from captioning.data.images import ImageLoadError
    from captioning.data.transforms import build_image_transform, model_input

    transform = build_image_transform(image_size)

    def load(path: Path) -> Any:
        try:
            return model_input(path, image_size, transform=transform)
        except ImageLoadError as e:
            return str(e)

    with ThreadPoolExecutor(max_workers=4) as pool:
        for s in range(0, len(paths), batch_size):
            chunk = list(range(s, min(len(paths), s + batch_size)))
            loaded = list(pool.map(load, [paths[i] for i in chunk]))
            good = [i for i, x in zip(chunk, loaded) if not isinstance(x, str)]
            images = torch.stack([x for x in loaded if not isinstance(x, str)]) if good else None
            failures = [(paths[i], x) for i, x in zip(chunk, loaded) if isinstance(x, str)]
            yield _Batch(good, [paths[i] for i in good], images, failures)


def _caption_batch(model: LoadedModel, batch: _Batch, device: torch.device,
                   settings: DecodeConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Decode one batch: one record per image (path, caption, score, tokens, finished, and
    with several captions an image, `captions`), and its `evaluation.predictions`."""
    import torch

    from captioning.evaluation import predictions

    with torch.inference_mode():
        gen = model.captioner.generate(batch.images.to(device), settings)
    pred = predictions(gen, model.vocab)
    finished = pred["generation"].finished.tolist()
    records = [{"path": str(path), "caption": c, "score": s, "tokens": c.split(),
                "finished": bool(f)}
               for path, c, s, f in zip(batch.paths, pred["captions"], pred["scores"], finished)]
    for rec, ranked in zip(records, pred.get("alternatives", ())):
        rec["captions"] = ranked
    return records, pred


def _write_overlays(model: LoadedModel, batch: _Batch, pred: dict[str, Any],
                    records: list[dict[str, Any]], device: torch.device,
                    targets: Sequence[Path]) -> int:
    """One strip per image, of its first caption (`evaluation.predictions`): the α map of
    every emitted word (hard models mark the location). Returns the number of strips that
    could not be written (each reported on stderr)."""
    from captioning.viz import caption_strips, save_strip_png

    gen, words = pred["generation"], pred["words"]  # word t is drawn over α_t
    hard = model.config.attention == "hard"
    _, strips = caption_strips(batch.images.to(device), gen.alphas, model.captioner.grid, words,
                               points=gen.locations if hard else None)
    failed = 0
    for rec, strip, target in zip(records, strips, targets):
        try:
            rec["overlay"] = str(save_strip_png(strip, target))
        except OSError as e:
            error(f"{target}: cannot write the overlay ({e.strerror or e})")
            failed += 1
    return failed
