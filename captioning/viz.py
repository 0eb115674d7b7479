"""Attention overlays (Xu et al. 2015, Fig. 2-3): one strip per caption, the image and then one
panel per generated word with the attention weights α_t (Eq. 4-5) upsampled over the image.

Everything is batched torch tensor ops on the tensors' device: the viridis colormap is a
lookup table interpolated from 33 anchor colours, and the labels are composed from a glyph
atlas of PIL's built-in default font rendered once per device. No matplotlib.
"""

from __future__ import annotations

import functools
import math
import sys
import unicodedata
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from captioning.data.transforms import IMAGENET_MEAN, IMAGENET_STD

UPSAMPLE_MODES: tuple[str, ...] = ("bicubic", "bilinear", "gaussian")
GAUSSIAN_SIGMA_CELLS = 0.6  # std of the "gaussian" upsampling kernel, in grid cells

# matplotlib's viridis (CC0) at indices 0, 8, ..., 248, 255 of its 256-entry table; linear
# interpolation between them reproduces the table to within 0.007.
_VIRIDIS_ANCHORS: tuple[tuple[float, float, float], ...] = (
    (0.267004, 0.004874, 0.329415), (0.277018, 0.050344, 0.375715),
    (0.282327, 0.094955, 0.417331), (0.282884, 0.135920, 0.453427),
    (0.278826, 0.175490, 0.483397), (0.270595, 0.214069, 0.507052),
    (0.258965, 0.251537, 0.524736), (0.244972, 0.287675, 0.537260),
    (0.229739, 0.322361, 0.545706), (0.214298, 0.355619, 0.551184),
    (0.199430, 0.387607, 0.554642), (0.185556, 0.418570, 0.556753),
    (0.172719, 0.448791, 0.557885), (0.160665, 0.478540, 0.558115),
    (0.149039, 0.508051, 0.557250), (0.137770, 0.537492, 0.554906),
    (0.127568, 0.566949, 0.550556), (0.120565, 0.596422, 0.543611),
    (0.120638, 0.625828, 0.533488), (0.132268, 0.655014, 0.519661),
    (0.157851, 0.683765, 0.501686), (0.196571, 0.711827, 0.479221),
    (0.246070, 0.738910, 0.452024), (0.304148, 0.764704, 0.419943),
    (0.369214, 0.788888, 0.382914), (0.440137, 0.811138, 0.340967),
    (0.515992, 0.831158, 0.294279), (0.595839, 0.848717, 0.243329),
    (0.678489, 0.863742, 0.189503), (0.762373, 0.876424, 0.137064),
    (0.845561, 0.887322, 0.099702), (0.926106, 0.897330, 0.104071),
    (0.993248, 0.906157, 0.143936),
)
_ANCHOR_POS: tuple[int, ...] = (*range(0, 256, 8), 255)

_MARKER_INNER = (255, 255, 255)  # hard-attention marker: white square ring ...
_MARKER_OUTER = (0, 0, 0)  # ... with a black ring on either side for contrast
_CHUNK_ELEMENTS = 1 << 23  # pixels x panels processed at once (bounds peak memory)


# --------------------------------------------------------------------------- assets


def _viridis_table() -> Tensor:
    """(256, 3) float64 viridis table in [0, 1], piecewise-linear between the anchors."""
    pos = torch.tensor(_ANCHOR_POS, dtype=torch.float64)
    anchors = torch.tensor(_VIRIDIS_ANCHORS, dtype=torch.float64)  # (33, 3)
    x = torch.arange(256, dtype=torch.float64)
    k = (torch.searchsorted(pos, x, right=True) - 1).clamp(0, len(pos) - 2)  # (256,)
    w = ((x - pos[k]) / (pos[k + 1] - pos[k])).unsqueeze(1)  # (256, 1)
    return anchors[k] * (1 - w) + anchors[k + 1] * w


@functools.lru_cache(maxsize=8)
def _lut(device: str) -> Tensor:
    return _viridis_table().float().to(device)


def viridis_lut(device: torch.device | str | None = None) -> Tensor:
    """The colormap as a (256, 3) float tensor in [0, 1] (row 255 is the high end)."""
    return _lut(str(torch.device(device or "cpu"))).clone()


@functools.lru_cache(maxsize=1)
def _glyph_atlas_cpu() -> tuple[Tensor, Tensor, int]:
    """Printable ASCII rendered with PIL's default font: (atlas (G, Hf, Wg) float coverage in
    [0, 1], advances (G,) long, left pad). Glyph g is chr(32 + g); glyph G-1 is blank, width 0.
    """
    from PIL import Image, ImageDraw, ImageFont

    font = ImageFont.load_default()
    chars = [chr(c) for c in range(32, 127)]
    boxes = [font.getbbox(c) for c in chars]  # (left, top, right, bottom), origin at ascender
    pad = max(0, -min(b[0] for b in boxes))
    height = max(b[3] for b in boxes)
    width = pad + max(b[2] for b in boxes)
    glyphs = torch.zeros(len(chars) + 1, height, width)
    for g, c in enumerate(chars):  # once per process: 95 tiny renders
        im = Image.new("L", (width, height), 0)
        ImageDraw.Draw(im).text((pad, 0), c, font=font, fill=255)
        glyphs[g] = torch.frombuffer(bytearray(im.tobytes()), dtype=torch.uint8).view(
            height, width
        ).float() / 255.0
    advances = torch.tensor([math.ceil(font.getlength(c)) for c in chars] + [0])
    return glyphs, advances, pad


@functools.lru_cache(maxsize=8)
def glyph_atlas(device: str) -> tuple[Tensor, Tensor, int]:
    """The label font's glyphs (atlas, advances, left pad), made once and kept per device."""
    glyphs, advances, pad = _glyph_atlas_cpu()
    return glyphs.to(device), advances.to(device), pad


def _char_codes(words: Sequence[str], device: torch.device) -> Tensor:
    """(M, C) long glyph indices; accents dropped ("café" -> "cafe"), other characters
    outside printable ASCII -> '?', padding -> the blank glyph."""
    blank, qmark = 95, ord("?") - 32
    words = [w if w.isascii() else "".join(
        ch for ch in unicodedata.normalize("NFKD", w) if not unicodedata.combining(ch))
        for w in words]
    rows = [[ord(ch) - 32 if 32 <= ord(ch) < 127 else qmark for ch in w] for w in words]
    c = max(1, max((len(r) for r in rows), default=0))
    return torch.tensor([r + [blank] * (c - len(r)) for r in rows], dtype=torch.long,
                        device=device).view(len(rows), c)


def render_labels(words: Sequence[str], width: int, height: int,
                  device: torch.device | str = "cpu") -> Tensor:
    """(M, height, width) float text coverage in [0, 1], each word centred in its box.

    Glyphs are placed with scatter_reduce(amax) from the cached atlas (overhangs are kept);
    text wider than `width` is cut at the right edge.
    """
    device = torch.device(device)
    atlas, advances, pad = glyph_atlas(str(device))
    _, hf, wg = atlas.shape
    m = len(words)
    if m == 0 or height <= 0:
        return torch.zeros(m, max(height, 0), width, device=device)
    codes = _char_codes(words, device)  # (M, C)
    c = codes.shape[1]
    adv = advances[codes]  # (M, C)
    starts = adv.cumsum(1) - adv  # (M, C) pen position of each character
    x0 = ((width - adv.sum(1)) // 2).clamp(min=0)  # (M,) centre the word
    cols = (x0[:, None, None] + starts[:, :, None] - pad
            + torch.arange(wg, device=device))  # (M, C, Wg) target columns
    cols = torch.where((cols >= 0) & (cols < width), cols, width)  # off-canvas -> trash column
    src = atlas[codes].permute(0, 2, 1, 3).reshape(m, hf, c * wg)  # (M, Hf, C*Wg)
    index = cols.reshape(m, 1, c * wg).expand(m, hf, c * wg)
    canvas = torch.zeros(m, hf, width + 1, device=device)
    canvas.scatter_reduce_(2, index, src, reduce="amax")
    text = canvas[:, :, :width]  # (M, Hf, W)
    out = torch.zeros(m, height, width, device=device)
    top = (height - hf) // 2  # centre vertically; crop rows when the strip is shorter
    src_lo, dst_lo = max(0, -top), max(0, top)
    rows = min(hf - src_lo, height - dst_lo)
    out[:, dst_lo : dst_lo + rows] = text[:, src_lo : src_lo + rows]
    return out


# --------------------------------------------------------------------------- maps


@functools.lru_cache(maxsize=32)
def _interp_weights(n_out: int, n_cells: int, mode: str, device: str) -> Tensor:
    """(n_out, n_cells) 1-D interpolation matrix; the 2-D upsampling is Wy · A · Wxᵀ.

    Bilinear and bicubic are separable, so interpolating the identity gives matrices that
    reproduce F.interpolate(align_corners=False) exactly while running as two small matmuls.
    "gaussian" is row-normalised Gaussian kernel regression on the cell centres.
    """
    if mode == "gaussian":
        cell = n_out / n_cells
        px = torch.arange(n_out, dtype=torch.float64) + 0.5
        centres = (torch.arange(n_cells, dtype=torch.float64) + 0.5) * cell
        w = torch.exp(-0.5 * ((px[:, None] - centres[None, :]) / (GAUSSIAN_SIGMA_CELLS * cell)) ** 2)
        w = w / w.sum(1, keepdim=True)
    else:
        eye = torch.eye(n_cells, dtype=torch.float64).view(n_cells, 1, n_cells, 1)
        w = F.interpolate(eye, size=(n_out, 1), mode=mode, align_corners=False)
        w = w.view(n_cells, n_out).T
    return w.float().contiguous().to(device)


def upsample_maps(maps: Tensor, size: tuple[int, int], mode: str = "bicubic") -> Tensor:
    """(N, T, gh, gw) attention maps -> (N, T, H, W), smooth and non-negative."""
    if mode not in UPSAMPLE_MODES:
        raise ValueError(f"upsample must be one of {UPSAMPLE_MODES}, got {mode!r}")
    _, _, gh, gw = maps.shape
    h, w = size
    wy = _interp_weights(h, gh, mode, str(maps.device))  # (H, gh)
    wx = _interp_weights(w, gw, mode, str(maps.device))  # (W, gw)
    up = torch.einsum("yi,ntij,xj->ntyx", wy, maps.float(), wx)  # (N, T, H, W)
    return up.clamp_(min=0) if mode == "bicubic" else up  # bicubic overshoots below zero


def _minmax_index(maps: Tensor) -> Tensor:
    """(..., H, W) maps -> (..., H*W) long colormap indices 0..255 after per-map min-max
    normalisation. Maps flat to within 0.1% (e.g. uniform α) map to 0 instead of amplifying
    float rounding noise into stripes."""
    flat = maps.flatten(-2)
    lo, hi = flat.amin(-1, keepdim=True), flat.amax(-1, keepdim=True)
    span = hi - lo
    flat_map = span <= 1e-3 * torch.maximum(hi.abs(), lo.abs()) + 1e-12
    scale = torch.where(flat_map, 0.0, 255.0 / span.clamp_min(1e-12))
    return torch.addcmul(-lo * scale, flat, scale).round_().clamp_(0, 255).long()


def _pack_rgb(rgb: Tensor) -> Tensor:
    """(..., 3) integer RGB in 0..255 -> (...,) int32 whose native-order bytes are R, G, B, 0."""
    shifts = (0, 8, 16) if sys.byteorder == "little" else (24, 16, 8)
    rgb = rgb.to(torch.int32)
    return (rgb[..., 0] << shifts[0]) | (rgb[..., 1] << shifts[1]) | (rgb[..., 2] << shifts[2])


def _draw_markers(packed: Tensor, points: Tensor, grid: tuple[int, int], white: int,
                  black: int) -> None:
    """Draw a square ring centred on each chosen cell into packed (n, T, H, W) int32 RGB, in
    place: white at Chebyshev distance half-1..half from the centre, black just inside and
    outside it. points (n, T) are flat cell indices; negative ones draw nothing. Only the ring
    pixels are touched (O(n·T·ring), not O(n·T·H·W))."""
    n, t, h, w = packed.shape
    gh, gw = grid
    ch, cw = h / gh, w / gw
    half = max(2, round(0.35 * min(ch, cw)))
    device = packed.device
    r = torch.div(points.clamp(min=0), gw, rounding_mode="floor")
    c = points.clamp(min=0) % gw
    cy = ((r.float() + 0.5) * ch).floor().long()  # (n, T) ring centre, pixels
    cx = ((c.float() + 0.5) * cw).floor().long()
    span = torch.arange(-half - 1, half + 2, device=device)
    dy, dx = torch.meshgrid(span, span, indexing="ij")
    d = torch.maximum(dy.abs(), dx.abs()).flatten()  # Chebyshev distance of the stencil
    dy, dx = dy.flatten(), dx.flatten()
    base = torch.arange(n * t, device=device).view(n, t, 1) * (h * w)
    flat = packed.view(-1)
    for colour, ring in ((black, (d == half + 1) | (d == half - 2)),
                         (white, (d == half) | (d == half - 1))):
        ys = cy[..., None] + dy[ring]  # (n, T, K)
        xs = cx[..., None] + dx[ring]
        ok = (ys >= 0) & (ys < h) & (xs >= 0) & (xs < w) & (points >= 0)[..., None]
        flat.index_fill_(0, (base + ys * w + xs)[ok], colour)


# --------------------------------------------------------------------------- strips


def denormalize(images: Tensor, mean: Sequence[float] = IMAGENET_MEAN,
                std: Sequence[float] = IMAGENET_STD) -> Tensor:
    """(N, 3, H, W) normalised images -> (N, H, W, 3) float RGB in [0, 1]."""
    m = torch.tensor(mean, device=images.device, dtype=torch.float32).view(1, 3, 1, 1)
    s = torch.tensor(std, device=images.device, dtype=torch.float32).view(1, 3, 1, 1)
    return (images.float() * s + m).clamp_(0, 1).permute(0, 2, 3, 1)


def _check_strip_args(images: Tensor, alphas: Tensor, grid: tuple[int, int],
                      words: Sequence[Sequence[str]], points: Tensor | None,
                      blend: float) -> int:
    """Validate `render_strips`' arguments; returns T_max, the longest caption's length."""
    if images.dim() != 4 or images.shape[1] != 3:
        raise ValueError(f"images must be (N, 3, H, W), got {tuple(images.shape)}")
    n = images.shape[0]
    gh, gw = grid
    if len(words) != n:
        raise ValueError(f"got {len(words)} captions for {n} images")
    t_max = max((len(ws) for ws in words), default=0)
    if alphas.dim() != 3 or alphas.shape[0] != n or alphas.shape[2] != gh * gw:
        raise ValueError(f"alphas must be (N={n}, T, L={gh * gw}), got {tuple(alphas.shape)}")
    if alphas.shape[1] < t_max:
        raise ValueError(f"alphas has {alphas.shape[1]} steps but a caption has {t_max} words")
    if points is not None and (points.shape[0] != n or points.shape[1] < t_max):
        raise ValueError(f"points must be (N={n}, T>={t_max}), got {tuple(points.shape)}")
    if not 0.0 <= blend <= 1.0:
        raise ValueError(f"blend must be in [0, 1], got {blend}")
    return t_max


def _paint_attention(panels: Tensor, rgb: Tensor, alphas: Tensor, grid: tuple[int, int],
                     words: Sequence[Sequence[str]], points: Tensor | None, upsample: str,
                     blend: float) -> None:
    """Fill the word panels (N, T_max, H, W, 3) uint8 in place: the (N, H, W, 3) images `rgb`
    blended with the coloured, upsampled α_t, hard-attention markers drawn, and black past
    each caption's end."""
    n, t_max, h, w, _ = panels.shape
    gh, gw = grid
    device = panels.device
    lengths = torch.tensor([len(ws) for ws in words], device=device)
    live = torch.arange(t_max, device=device)[None, :] < lengths[:, None]  # (N, T)
    # blend in packed int32 RGB: floor(blend·255·cmap) + round((1-blend)·255·image) <= 255 per
    # channel, so the sum never carries into the next channel's byte
    lut = _pack_rgb((_lut(str(device)) * (blend * 255.0)).floor_())  # (256,)
    base = _pack_rgb((rgb * ((1.0 - blend) * 255.0)).round_()).view(n, 1, h * w)  # (N, 1, HW)
    maps_all = alphas[:, :t_max].to(device=device, dtype=torch.float32).reshape(n, t_max, gh, gw)
    if points is not None:
        points = points[:, :t_max].to(device=device, dtype=torch.long)
    white = int(_pack_rgb(torch.tensor(_MARKER_INNER)))
    black = int(_pack_rgb(torch.tensor(_MARKER_OUTER)))

    step = max(1, _CHUNK_ELEMENTS // (t_max * h * w))
    for s in range(0, n, step):  # chunks of captions, to bound memory
        e = min(n, s + step)
        idx = _minmax_index(upsample_maps(maps_all[s:e], (h, w), upsample))  # (n, T, HW)
        packed = torch.take(lut, idx).add_(base[s:e])  # (n, T, HW) int32 RGB
        packed = packed.view(e - s, t_max, h, w)
        if points is not None:
            _draw_markers(packed, points[s:e], grid, white, black)
        packed.mul_(live[s:e, :, None, None])  # blank panels past the caption's end
        panels[s:e] = packed.view(torch.uint8).view(e - s, t_max, h, w, 4)[..., :3]


def _paint_labels(panels: Tensor, words: Sequence[Sequence[str]]) -> None:
    """Write words[n][t] into the label panels (N, T_max, label_height, W, 3) uint8, in place."""
    n, t_max, label_height, w, _ = panels.shape
    flat_words = [ws[t] if t < len(ws) else "" for ws in words for t in range(t_max)]
    text = render_labels(flat_words, w, label_height, panels.device)  # (N*T, lh, W)
    text = (text * 255).round_().to(torch.uint8).view(n, t_max, label_height, w, 1)
    panels[:] = text.expand(-1, -1, -1, -1, 3)


@torch.no_grad()
def render_strips(
    images: Tensor,
    alphas: Tensor,
    grid: tuple[int, int],
    words: Sequence[Sequence[str]],
    *,
    mean: Sequence[float] = IMAGENET_MEAN,
    std: Sequence[float] = IMAGENET_STD,
    points: Tensor | None = None,
    upsample: str = "bicubic",
    blend: float = 0.5,
    label_height: int = 14,
) -> Tensor:
    """Attention strips for a batch of captions.

    images (N, 3, H, W) normalised with `mean`/`std`; alphas (N, T, L) with L = gh*gw
    (row-major grid) and T >= the longest caption; words[n] the generated words of caption n
    (alphas[n, t] is the attention used to emit words[n][t]); points (N, T) long, the location
    sampled by hard attention at each step (marked with a square ring at that cell; -1 = none).

    Returns (N, H + label_height, W * (T_max + 1), 3) uint8 with T_max = max len(words[n]):
    panel 0 is the image, panel t+1 the image blended (weight `blend`) with the viridis-coloured
    α_t, upsampled smoothly ("bicubic", "bilinear" or "gaussian") and min-max normalised per
    map, with words[n][t] written in the label strip below. Panels past a caption's end are
    black. Runs on the images' device.
    """
    t_max = _check_strip_args(images, alphas, grid, words, points, blend)
    n, _, h, w = images.shape
    label_height = max(0, int(label_height))
    device = images.device

    out = torch.zeros(n, h + label_height, w * (t_max + 1), 3, dtype=torch.uint8, device=device)
    image_panels = out[:, :h].view(n, h, t_max + 1, w, 3).permute(0, 2, 1, 3, 4)  # (N,T+1,H,W,3)
    rgb = denormalize(images, mean, std)  # (N, H, W, 3)
    image_panels[:, 0] = (rgb * 255).round_().to(torch.uint8)
    if t_max == 0:
        return out
    _paint_attention(image_panels[:, 1:], rgb, alphas, grid, words, points, upsample, blend)
    if label_height > 0:
        label_panels = out[:, h:].view(n, label_height, t_max + 1, w, 3).permute(0, 2, 1, 3, 4)
        _paint_labels(label_panels[:, 1:], words)
    return out


def caption_strips(images: Tensor, alphas: Tensor, grid: tuple[int, int],
                   words: Sequence[Sequence[str]], *, points: Tensor | None = None,
                   upsample: str = "bicubic") -> tuple[Tensor, list[Tensor]]:
    """`render_strips` on the CPU, of images in float32 whatever the run's precision (α may be
    wider than the longest caption, and in any float dtype): the batch's strips, all as wide as
    the longest caption's (N, H', W'), and each cut to its own caption's panels."""
    full = render_strips(images.float(), alphas, grid, words, points=points,
                         upsample=upsample).cpu()
    width = images.shape[-1]
    return full, [strip[:, : width * (len(w) + 1)] for strip, w in zip(full, words)]


def save_strip_png(strip: Tensor, path: str | Path) -> Path:
    """Write one (H, W, 3) uint8 strip as PNG, atomically (a killed write leaves no partial
    PNG under the name); parent folders are created."""
    from PIL import Image

    from captioning.atomic import write_atomic

    if strip.dim() != 3 or strip.shape[2] != 3 or strip.dtype != torch.uint8:
        raise ValueError(f"strip must be (H, W, 3) uint8, got {tuple(strip.shape)} {strip.dtype}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    image = Image.fromarray(strip.detach().cpu().contiguous().numpy())
    return write_atomic(path, lambda tmp: image.save(tmp, format="PNG"))
