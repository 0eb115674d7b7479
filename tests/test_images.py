"""The image loader and checker: every mode to RGB, EXIF orientation, bad files."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from captioning.data.images import ImageLoadError, check_image, load_image, to_rgb
from captioning.data.transforms import build_image_transform


def _save(path: Path, im: Image.Image, **kw: Any) -> Path:
    im.save(path, **kw)
    return path


def _rgb_at(path: Path, xy: tuple[int, int] = (0, 0)) -> tuple[int, ...]:
    im = load_image(path)
    assert im.mode == "RGB"
    return im.getpixel(xy)


def test_load_image_converts_every_mode(tmp_path: Path) -> None:
    t = tmp_path
    assert _rgb_at(_save(t / "rgb.png", Image.new("RGB", (3, 2), (10, 20, 30)))) == (10, 20, 30)
    assert _rgb_at(_save(t / "l.png", Image.new("L", (3, 2), 77))) == (77, 77, 77)
    assert _rgb_at(_save(t / "1.png", Image.new("1", (3, 2), 1))) == (255, 255, 255)
    # Alpha is composited over white, for every alpha mode.
    assert _rgb_at(_save(t / "la.png", Image.new("LA", (3, 2), (0, 0)))) == (255, 255, 255)
    assert _rgb_at(_save(t / "rgba0.png", Image.new("RGBA", (3, 2), (255, 0, 0, 0)))) == \
        (255, 255, 255)
    r, g, b = _rgb_at(_save(t / "rgba.png", Image.new("RGBA", (3, 2), (255, 0, 0, 128))))
    assert r == 255 and 120 <= g == b <= 135
    p = Image.new("P", (2, 1))
    p.putpalette([255, 0, 0, 0, 0, 255] + [0] * 762)
    p.putpixel((1, 0), 1)
    _save(t / "p.png", p, transparency=1)
    assert _rgb_at(t / "p.png", (0, 0)) == (255, 0, 0)
    assert _rgb_at(t / "p.png", (1, 0)) == (255, 255, 255)  # transparent index
    q = p.copy()
    q.info.pop("transparency", None)
    assert _rgb_at(_save(t / "p_opaque.png", q), (1, 0)) == (0, 0, 255)
    cmyk = _save(t / "cmyk.tif", Image.new("CMYK", (3, 2), (0, 255, 255, 0)))
    assert Image.open(cmyk).mode == "CMYK"
    assert _rgb_at(cmyk) == (255, 0, 0)
    assert _rgb_at(_save(t / "cmyk.jpg", Image.new("CMYK", (8, 8), (0, 255, 255, 0)))) \
        [0] > 240


def test_high_bit_depth_is_scaled_not_clipped(tmp_path: Path) -> None:
    a16 = np.array([[0, 32896, 65535]], dtype=np.uint16)
    f16 = _save(tmp_path / "i16.png", Image.fromarray(a16))
    assert Image.open(f16).mode == "I;16"
    im = load_image(f16)
    assert [im.getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    fi = _save(tmp_path / "i.tif", Image.fromarray(a16.astype(np.int32)))
    assert Image.open(fi).mode == "I"
    assert [load_image(fi).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    fneg = _save(tmp_path / "ineg.tif", Image.fromarray(np.array([[-1000, 0, 1000]],
                                                                  dtype=np.int32)))
    assert [load_image(fneg).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]
    ff = _save(tmp_path / "f.tif", Image.fromarray(np.array([[0, 0.5, 1.0]], dtype=np.float32)))
    assert Image.open(ff).mode == "F"
    assert [load_image(ff).getpixel((x, 0))[0] for x in range(3)] == [0, 128, 255]


@pytest.mark.parametrize(("mode", "colour", "rgb"), [
    ("I;16B", 32896, (128, 128, 128)),  # scaled from 16 bits, not clipped to white
    ("YCbCr", (76, 85, 255), (254, 0, 0)),  # red
    ("LAB", (255, 128, 128), (255, 255, 255)),  # white (Pillow's LAB conversion: within 2)
    ("HSV", (0, 255, 255), (255, 0, 0)),  # red
    ("RGBX", (10, 20, 30, 0), (10, 20, 30)),  # the padding byte dropped
    ("PA", (0, 0), (255, 255, 255)),  # a red palette entry, fully transparent: the background
])
def test_in_memory_modes_convert_to_rgb(mode: str, colour: Any, rgb: tuple[int, int, int]
                                        ) -> None:
    """Modes Pillow may produce in memory (not all of them save to a file) convert too."""
    im = Image.new(mode, (2, 2), colour)
    if mode == "PA":
        im.putpalette([255, 0, 0] * 256)
    out = to_rgb(im)
    assert out.mode == "RGB" and out.size == (2, 2)
    assert all(abs(a - b) <= 2 for a, b in zip(out.getpixel((1, 1)), rgb, strict=True)), \
        out.getpixel((1, 1))


def test_exif_orientation_is_applied(tmp_path: Path) -> None:
    im = Image.new("RGB", (40, 20), (255, 0, 0))
    im.paste((0, 0, 255), (20, 0, 40, 20))  # left half red, right half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90 degrees clockwise to display
    f = _save(tmp_path / "rot.jpg", im, exif=exif.tobytes(), quality=95)
    out = load_image(f)
    assert out.size == (20, 40)
    top, bottom = out.getpixel((10, 5)), out.getpixel((10, 35))
    assert top[0] > 200 and top[2] < 60  # the left (red) half is now on top
    assert bottom[2] > 200 and bottom[0] < 60
    assert check_image(f) == (20, 40)


@pytest.mark.parametrize("size", [(1, 1), (1, 300), (300, 1)])
def test_tiny_and_extreme_aspect_images(tmp_path: Path, size: tuple[int, int]) -> None:
    f = _save(tmp_path / "x.png", Image.new("RGB", size, (0, 255, 0)))
    assert load_image(f).size == size
    assert check_image(f) == size
    x = build_image_transform(16)(load_image(f))
    assert x.shape == (3, 16, 16) and torch.isfinite(x).all()


def _truncate(path: Path) -> Path:
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    return path


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(("make", "reason"), [
    (lambda d: d / "missing.jpg", "does not exist"),
    (lambda d: _write(d / "empty.jpg", b""), "empty (0 bytes)"),
    (lambda d: _write(d / "text.jpg", b"hello, not an image"), "not an image"),
    (lambda d: _truncate(_save(d / "t.png", Image.effect_noise((64, 64), 50).convert("RGB"))),
     "truncated"),
    (lambda d: _truncate(_save(d / "t.jpg", Image.effect_noise((64, 64), 50).convert("RGB"))),
     "truncated"),
    (lambda d: d, "directory"),
])
def test_bad_files_raise_image_load_error(tmp_path: Path, make: Callable, reason: str) -> None:
    f = make(tmp_path)
    for fn in (load_image, check_image):
        with pytest.raises(ImageLoadError) as info:
            fn(f)
        assert str(f) in str(info.value)
        assert reason in str(info.value)
        assert isinstance(info.value, ValueError)


def test_corrupt_png_is_caught_by_check_image(tmp_path: Path) -> None:
    f = _save(tmp_path / "c.png", Image.effect_noise((32, 32), 40).convert("RGB"))
    data = bytearray(f.read_bytes())
    data[200] ^= 0xFF  # inside IDAT: the chunk CRC no longer matches
    f.write_bytes(bytes(data))
    with pytest.raises(ImageLoadError, match=r"c\.png"):
        check_image(f)


def test_huge_images_get_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    f = _save(tmp_path / "big.png", Image.new("RGB", (64, 64)))
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 100)
    for fn in (load_image, check_image):
        with pytest.raises(ImageLoadError, match=r"too large.*MAX_IMAGE_PIXELS"):
            fn(f)


def test_rgba_palette_and_jpeg_draft(tmp_path: Path) -> None:
    p = Image.new("P", (2, 1))
    p.putpalette(bytes([255, 0, 0, 255, 0, 0, 255, 0]) + bytes(1016), "RGBA")
    p.putpixel((1, 0), 1)
    assert to_rgb(p).getpixel((0, 0)) == (255, 0, 0)
    assert to_rgb(p).getpixel((1, 0)) == (255, 255, 255)  # alpha 0 in the palette
    f = _save(tmp_path / "big.jpg", Image.new("RGB", (400, 240), (0, 128, 0)))
    small = load_image(f, min_side=50)
    assert min(small.size) >= 50 and small.size[0] < 400  # decoded at a reduced scale
    assert load_image(f).size == (400, 240)


def _png_with_bad_zlib(path: Path) -> Path:
    """A PNG whose IDAT data is corrupt but whose chunk CRCs are valid."""
    import struct
    import zlib

    data = bytearray(_save(path, Image.effect_noise((32, 32), 40).convert("RGB")).read_bytes())
    at = data.index(b"IDAT")
    length = struct.unpack(">I", data[at - 4:at])[0]
    for i in range(at + 4 + 2, at + 4 + length):  # past the zlib header
        data[i] = 0xFF
    data[at + 4 + length:at + 8 + length] = struct.pack(
        ">I", zlib.crc32(bytes(data[at:at + 4 + length])))
    path.write_bytes(bytes(data))
    return path


class _Images(torch.utils.data.Dataset):
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.from_numpy(np.asarray(load_image(self.paths[i])).copy())


def test_a_bad_image_in_a_dataloader_worker_is_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from captioning.commands.errors import exit_status

    f = _png_with_bad_zlib(tmp_path / "z.png")
    check_image(f)  # passes: only the decode finds the fault
    loader = torch.utils.data.DataLoader(_Images([f]), num_workers=1)
    with pytest.raises(ImageLoadError) as info:
        next(iter(loader))
    assert info.value.path == f and str(info.value) == f"{f}: {info.value.reason}"
    assert exit_status(info.value) == 1
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {f}: ") and "Traceback" not in line


def test_a_nul_byte_in_a_path_is_an_image_load_error(tmp_path: Path) -> None:
    f = tmp_path / "a\0b.png"
    for fn in (load_image, check_image):
        with pytest.raises(ImageLoadError, match="not a usable file name") as info:
            fn(f)
        assert info.value.path == f


def test_a_jpeg_with_trailing_data_is_valid(tmp_path: Path) -> None:
    f = _save(tmp_path / "t.jpg", Image.effect_noise((64, 64), 50).convert("RGB"))
    f.write_bytes(f.read_bytes() + b"\0" * 4096)  # e.g. a camera's appended data
    assert check_image(f) == (64, 64)
    assert load_image(f).size == (64, 64)
