"""The one image loader, shared by the data pipeline and the caption CLI.

`load_image` returns an RGB `PIL.Image` for every mode Pillow opens, with the EXIF orientation
applied, and turns every failure into an `ImageLoadError` that names the file and the reason.
`check_image` is the cheap setup-time check (header + `verify`, no pixel decode).
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import ExifTags, Image, ImageOps, UnidentifiedImageError

from captioning.data.problems import MISSING

log = logging.getLogger(__name__)

#: Colour that transparent pixels are composited over (every alpha mode uses the same one).
ALPHA_BACKGROUND: tuple[int, int, int] = (255, 255, 255)

_ALPHA_MODES = frozenset({"RGBA", "RGBa", "LA", "La", "PA"})
_HIGH_DEPTH_MODES = frozenset({"I", "F", "I;16", "I;16L", "I;16B", "I;16N"})
# EXIF orientations that swap width and height (transpose, rotate 90/270, transverse).
_SWAPPING_ORIENTATIONS = frozenset({5, 6, 7, 8})


class ImageLoadError(ValueError):
    """An image file could not be read; the message names the file and the reason."""

    def __init__(self, path: str | os.PathLike[str], reason: str | None = None) -> None:
        if reason is None:  # from a DataLoader worker: torch re-raises `ImageLoadError(text)`
            text = str(path).strip()
            line = text.splitlines()[-1].split("ImageLoadError: ", 1)[-1] if text else text
            path, _, reason = line.partition(": ")
        self.path = Path(path)
        self.reason = reason
        super().__init__(f"{self.path}: {reason}")


def max_pixels() -> int | None:
    """The largest image (in pixels) we decode: Pillow's decompression-bomb error threshold."""
    limit = Image.MAX_IMAGE_PIXELS
    return None if limit is None else 2 * int(limit)


def image_size_ok(width: int, height: int) -> bool:
    """True when a `width` x `height` image is non-empty and under `max_pixels()`."""
    limit = max_pixels()
    return width > 0 and height > 0 and (limit is None or width * height <= limit)


def _too_large(path: Path, detail: str) -> ImageLoadError:
    return ImageLoadError(
        path,
        f"image is too large to decode safely ({detail}); if the file is trusted, raise "
        "PIL.Image.MAX_IMAGE_PIXELS",
    )


def _precheck(path: Path) -> None:
    """Raise for missing, non-regular and zero-byte files (no decoding)."""
    try:
        st = path.stat()
    except FileNotFoundError:
        raise ImageLoadError(path, MISSING) from None
    except OSError as e:
        raise ImageLoadError(path, f"cannot access file ({e.strerror or e})") from e
    except ValueError as e:  # "embedded null byte": no file can have this name
        raise ImageLoadError(path, f"not a usable file name ({e})") from None
    if path.is_dir():
        raise ImageLoadError(path, "is a directory, not an image file")
    if st.st_size == 0:
        raise ImageLoadError(path, "file is empty (0 bytes)")


def _classify(path: Path, err: BaseException) -> ImageLoadError:
    """Map a Pillow/OS exception to an ImageLoadError with a readable reason."""
    if isinstance(err, ImageLoadError):
        return err
    if isinstance(err, Image.DecompressionBombError):
        return _too_large(path, str(err))
    if isinstance(err, UnidentifiedImageError):
        return ImageLoadError(path, "not an image (Pillow cannot identify the file format)")
    msg = str(err) or type(err).__name__
    low = msg.lower()
    if "truncated" in low or isinstance(err, EOFError) or "premature end" in low:
        return ImageLoadError(path, f"truncated image file ({msg})")
    if isinstance(err, PermissionError):
        return ImageLoadError(path, "permission denied")
    return ImageLoadError(path, f"corrupt image file ({type(err).__name__}: {msg})")


def _to_uint8(arr: np.ndarray, mode: str) -> np.ndarray:
    """Scale a high-bit-depth single-channel array to uint8 without clipping.

    16-bit integer modes map their full range (0..65535) linearly onto 0..255. Mode "I"
    (32-bit int) and "F" (float) have no fixed range: values already inside 0..255 (or 0..1 for
    floats) are kept, values inside 0..65535 are treated as 16-bit, anything else is
    min-max stretched.
    """
    a = np.nan_to_num(arr.astype(np.float64, copy=False), nan=0.0, posinf=0.0, neginf=0.0)
    if mode.startswith("I;16"):
        scaled = a / 257.0
    else:
        lo, hi = (float(a.min()), float(a.max())) if a.size else (0.0, 0.0)
        if mode == "F" and lo >= 0.0 and hi <= 1.0:
            scaled = a * 255.0
        elif lo >= 0.0 and hi <= 255.0:
            scaled = a
        elif mode == "I" and lo >= 0.0 and hi <= 65535.0:
            scaled = a / 257.0
        elif hi > lo:
            scaled = (a - lo) * (255.0 / (hi - lo))
        else:
            scaled = np.zeros_like(a)
    return np.clip(np.rint(scaled), 0, 255).astype(np.uint8)


def to_rgb(im: Image.Image) -> Image.Image:
    """Convert any Pillow mode to RGB; alpha is composited over `ALPHA_BACKGROUND`."""
    mode = im.mode
    if mode == "RGB":
        return im
    if mode in _HIGH_DEPTH_MODES:
        gray = Image.fromarray(_to_uint8(np.asarray(im), mode))
        return gray.convert("RGB")
    if mode == "P" and ("transparency" in im.info or getattr(im.palette, "mode", "") == "RGBA"):
        im, mode = im.convert("RGBA"), "RGBA"
    if mode in _ALPHA_MODES:
        rgba = im.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (*ALPHA_BACKGROUND, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    # 1, L, P, CMYK, YCbCr, RGBX, HSV, ... all have direct RGB conversions.
    return im.convert("RGB")


@contextlib.contextmanager
def _open(path: Path) -> Iterator[Image.Image]:
    """`Image.open(path)` without Pillow's decompression-bomb warning: images up to
    `max_pixels()` are accepted; beyond it Pillow raises the error that `_classify` reports."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        with Image.open(path) as im:
            yield im


def draft(im: Image.Image, min_side: int | None) -> None:
    """Have a JPEG not yet decoded decode at the smallest DCT scale that keeps both sides >=
    `min_side` (Pillow's `draft`, in place; nothing for other formats or without `min_side`)."""
    if min_side is not None and im.format == "JPEG":
        im.draft(im.mode, (min_side, min_side))


def load_image(path: str | os.PathLike[str], *, min_side: int | None = None) -> Image.Image:
    """Open `path` as an RGB image with its EXIF orientation applied.

    `min_side` is an optional decoding hint: JPEGs may be decoded at a reduced scale (DCT
    scaling) as long as both sides stay >= `min_side`; other formats ignore it.
    Raises `ImageLoadError` (a `ValueError`) naming the file and the reason.
    """
    path = Path(path)
    _precheck(path)
    try:
        with _open(path) as im:
            draft(im, min_side)
            im.load()
            try:
                ImageOps.exif_transpose(im, in_place=True)
            except Exception as e:  # a broken EXIF block must not lose the image
                log.debug("%s: ignoring unreadable EXIF orientation (%s)", path, e)
    except Exception as e:
        raise _classify(path, e) from e
    try:
        out = to_rgb(im)
    except (ValueError, OSError) as e:
        raise ImageLoadError(path, f"unsupported image mode {im.mode!r} ({e})") from e
    w, h = out.size
    if w <= 0 or h <= 0:
        raise ImageLoadError(path, f"image has no pixels ({w}x{h})")
    return out


def _jpeg_has_end_marker(path: Path) -> bool:
    """Cheap truncation test for JPEG: the EOI marker must be near the end of the file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        f.seek(max(0, size - 1024))
        tail = f.read()
    return b"\xff\xd9" in tail


def _header_orientation(im: Image.Image) -> int:
    """EXIF orientation readable without decoding (JPEG/TIFF/WebP headers, early PNG eXIf)."""
    try:
        if im.format in ("JPEG", "MPO", "TIFF", "WEBP"):
            exif = im.getexif()
        elif isinstance(im.info.get("exif"), bytes):
            exif = Image.Exif()
            exif.load(im.info["exif"])
        else:
            return 1
        return int(exif.get(ExifTags.Base.Orientation, 1))
    except Exception:  # unreadable EXIF: load_image ignores it too
        return 1


def image_problems(paths: Sequence[str | os.PathLike[str]]) -> list[str | None]:
    """Why each image cannot be used (`check_image`'s reason), or None where it can; checked
    in threads (the checks wait on the disk)."""
    def reason(path: str | os.PathLike[str]) -> str | None:
        try:
            check_image(path)
        except ImageLoadError as e:
            return e.reason
        return None

    with ThreadPoolExecutor(min(32, 4 * (os.cpu_count() or 1))) as pool:
        return list(pool.map(reason, paths, chunksize=256))


def check_image(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Validate an image file cheaply and return its (width, height) after EXIF orientation.

    Reads the header, runs `Image.verify` (PNG: chunk CRCs; others: structure) and, for JPEG,
    checks for the end-of-image marker; no pixel data is decoded unless a JPEG's marker is not
    near its end (a fully decoded JPEG with trailing data passes). Raises `ImageLoadError`.
    """
    path = Path(path)
    _precheck(path)
    try:
        with _open(path) as im:
            w, h = im.size
            fmt = im.format
            orientation = _header_orientation(im)
            im.verify()
    except Exception as e:
        raise _classify(path, e) from e
    if not image_size_ok(w, h):
        if w <= 0 or h <= 0:
            raise ImageLoadError(path, f"image has no pixels ({w}x{h})")
        raise _too_large(path, f"{w}x{h} = {w * h} pixels > limit {max_pixels()}")
    if fmt == "JPEG" and not _jpeg_has_end_marker(path):
        load_image(path)  # trailing data after the end marker is valid: decode to be sure
    return (h, w) if orientation in _SWAPPING_ORIENTATIONS else (w, h)
