"""Attention overlays: layout, colours, labels, hard-attention markers, batching."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from captioning import viz
from captioning.viz import (
    IMAGENET_MEAN,
    IMAGENET_STD,
    caption_strips,
    render_strips,
    save_strip_png,
)

H = W = 64
LH = 14


def normalise(rgb: torch.Tensor) -> torch.Tensor:
    """(N, 3, H, W) RGB in [0, 1] -> model input normalised with the ImageNet statistics."""
    m = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    s = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    return (rgb - m) / s


def one_hot_alphas(n: int, t: int, grid: tuple[int, int], cells: list[list[int]]) -> torch.Tensor:
    a = torch.zeros(n, t, grid[0] * grid[1])
    for i, row in enumerate(cells):
        for k, cell in enumerate(row):
            a[i, k, cell] = 1.0
    return a


def panel(out: torch.Tensor, i: int, p: int, *, label: bool = False) -> torch.Tensor:
    """Panel p (0 = image) of strip i: (H, W, 3), or its label strip (LH, W, 3)."""
    rows = slice(H, None) if label else slice(0, H)
    return out[i, rows, p * W : (p + 1) * W].int()


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor, list[list[str]]]:
    g = torch.Generator().manual_seed(0)
    rgb = torch.rand(3, 3, H, W, generator=g)
    alphas = torch.softmax(torch.randn(3, 5, 16, generator=g) * 2, -1)
    words = [["a", "red", "circle", "and", "square"], ["two", "triangles"], ["x"]]
    return normalise(rgb), alphas, words


def test_shape_dtype_and_blank_panels(batch) -> None:
    images, alphas, words = batch
    out = render_strips(images, alphas, (4, 4), words, label_height=LH)
    assert out.shape == (3, H + LH, W * 6, 3)
    assert out.dtype == torch.uint8
    for i, ws in enumerate(words):
        for p in range(1, 6):
            img, lab = panel(out, i, p), panel(out, i, p, label=True)
            if p <= len(ws):
                assert img.float().std() > 0 and img.max() > 0  # a real overlay
                assert lab.max() > 0  # the word is written
            else:
                assert img.max() == 0 and lab.max() == 0  # past the caption: black
        assert panel(out, i, 0, label=True).max() == 0  # no label under the image


def test_panel_zero_is_the_denormalised_image() -> None:
    rgb = torch.rand(2, 3, H, W, generator=torch.Generator().manual_seed(1))
    out = render_strips(normalise(rgb), torch.full((2, 1, 4), 0.25), (2, 2), [["a"], ["b"]])
    expected = (rgb * 255).permute(0, 2, 3, 1)
    assert (out[:, :H, :W].float() - expected).abs().max() <= 1.0


def test_label_height_zero_and_custom_mean_std() -> None:
    rgb = torch.rand(1, 3, H, W)
    mean, std = (0.5, 0.5, 0.5), (0.5, 0.5, 0.5)
    out = render_strips((rgb - 0.5) / 0.5, torch.rand(1, 2, 4), (2, 2), [["a", "b"]],
                        mean=mean, std=std, label_height=0)
    assert out.shape == (1, H, 3 * W, 3)
    assert (out[0, :, :W].float() - rgb[0].permute(1, 2, 0) * 255).abs().max() <= 1.0


@pytest.mark.parametrize("mode", ["bicubic", "bilinear", "gaussian"])
def test_one_hot_attention_is_hottest_at_its_cell(mode: str) -> None:
    grid, cell = (8, 8), H // 8
    black = normalise(torch.zeros(1, 3, H, W))  # the panel is then blend * colormap
    i, j = 2, 5
    alphas = one_hot_alphas(1, 1, grid, [[i * 8 + j]])
    out = render_strips(black, alphas, grid, [["w"]], upsample=mode, blend=0.5)
    lut = viz.viridis_lut()
    hot, cold = (lut[255] * 127.5).floor(), (lut[0] * 127.5).floor()
    p = panel(out, 0, 1).float()
    dist_hot = (p - hot).abs().amax(-1)  # (H, W)
    dist_cold = (p - cold).abs().amax(-1)
    centre = p[i * cell + cell // 2 - 1 : i * cell + cell // 2 + 1,
               j * cell + cell // 2 - 1 : j * cell + cell // 2 + 1]
    assert (centre - hot).abs().max() <= 4  # the max-end colour at the cell centre
    y, x = divmod(int(dist_hot.argmin()), W)
    assert i * cell <= y < (i + 1) * cell and j * cell <= x < (j + 1) * cell
    yy, xx = torch.meshgrid(torch.arange(H), torch.arange(W), indexing="ij")
    far = ((yy - (i + 0.5) * cell).abs() > 3 * cell) | ((xx - (j + 0.5) * cell).abs() > 3 * cell)
    assert dist_cold[far].max() <= 4  # far away: the low end of the colormap
    assert dist_hot[far].min() > 60


def test_bilinear_and_bicubic_match_interpolate() -> None:
    maps = torch.rand(2, 3, 7, 5)
    for mode in ("bilinear", "bicubic"):
        ref = F.interpolate(maps.view(6, 1, 7, 5), size=(56, 40), mode=mode, align_corners=False)
        ref = ref.view(2, 3, 56, 40).clamp(min=0)
        assert torch.allclose(viz.upsample_maps(maps, (56, 40), mode), ref, atol=1e-5)


def test_colormap_is_viridis_like() -> None:
    lut = viz.viridis_lut()
    assert lut.shape == (256, 3)
    assert torch.allclose(lut[0], torch.tensor([0.267004, 0.004874, 0.329415]), atol=1e-6)
    assert torch.allclose(lut[255], torch.tensor([0.993248, 0.906157, 0.143936]), atol=1e-6)
    assert torch.allclose(lut[128], torch.tensor([0.127568, 0.566949, 0.550556]), atol=1e-6)
    luminance = lut @ torch.tensor([0.2126, 0.7152, 0.0722])
    assert (luminance.diff() > 0).all()  # perceptually ordered: brightness rises


def test_labels_are_written_and_differ() -> None:
    text = viz.render_labels(["circle", "a", "", "circle"], 64, LH, torch.device("cpu"))
    assert text.shape == (4, LH, 64)
    assert text[0].max() > 0.5 and text[1].max() > 0.5
    assert text[2].max() == 0  # empty word: nothing
    assert torch.equal(text[0], text[3])
    assert (text[0] > 0).sum() > (text[1] > 0).sum()  # longer word, more ink
    cols = (text[1] > 0).any(0).nonzero().flatten()
    assert abs((cols.min() + cols.max()).item() / 2 - 32) <= 4  # centred
    wide = viz.render_labels(["m" * 40], 64, LH, torch.device("cpu"))
    assert wide.shape == (1, LH, 64) and wide.max() > 0  # cut at the edge, no error
    accents = viz.render_labels(["café", "cafe", "caf?", "猫"], 64, LH, torch.device("cpu"))
    assert torch.equal(accents[0], accents[1])  # drawn without its accent, not as "caf?"
    assert not torch.equal(accents[0], accents[2])
    assert torch.equal(accents[3], viz.render_labels(["?"], 64, LH, torch.device("cpu"))[0])


def test_glyph_atlas_is_cached_per_device() -> None:
    assert viz.glyph_atlas("cpu") is viz.glyph_atlas("cpu")
    atlas, advances, _ = viz.glyph_atlas("cpu")
    assert atlas.shape[0] == 96 and advances[-1] == 0  # 95 printable ASCII + a blank glyph
    assert atlas[ord("A") - 32].max() > 0.5 and atlas[0].max() == 0  # "A" has ink, " " none


def test_hard_attention_marker_changes_only_its_cell() -> None:
    g = torch.Generator().manual_seed(3)
    images = normalise(torch.rand(1, 3, H, W, generator=g))
    alphas = torch.softmax(torch.randn(1, 2, 16, generator=g), -1)
    words = [["a", "b"]]
    plain = render_strips(images, alphas, (4, 4), words)
    points = torch.tensor([[9, -1]])  # step 0 -> cell (2, 1); step 1: no marker
    marked = render_strips(images, alphas, (4, 4), words, points=points)
    diff = (marked[0] != plain[0]).any(-1)  # (H+LH, W*3)
    changed = diff[:H, W : 2 * W].nonzero()
    assert len(changed) > 0
    cell = H // 4
    cy, cx = 2 * cell + cell // 2, 1 * cell + cell // 2
    assert (changed[:, 0] - cy).abs().max() <= cell // 2 + 2
    assert (changed[:, 1] - cx).abs().max() <= cell // 2 + 2
    assert not diff[:, :W].any() and not diff[:, 2 * W :].any() and not diff[H:].any()
    assert (marked[0, cy - 6 : cy + 7, W + cx - 6 : W + cx + 7] == 255).all(-1).any()  # white


def test_batched_equals_one_by_one(batch) -> None:
    images, alphas, words = batch
    points = alphas.argmax(-1)
    out = render_strips(images, alphas, (4, 4), words, points=points, upsample="gaussian")
    for i, ws in enumerate(words):
        alone = render_strips(images[i : i + 1], alphas[i : i + 1], (4, 4), [ws],
                              points=points[i : i + 1], upsample="gaussian")
        # Equal up to one level of uint8 rounding: BLAS may sum a batch in another order.
        diff = (out[i, :, : W * (len(ws) + 1)].int() - alone[0].int()).abs()
        assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3


def test_caption_strips_of_a_bf16_run_cut_to_the_longest_caption(batch) -> None:
    """The images and maps of a bf16-mixed run, the maps wider than the captions (decoding's
    max_len), give the strips of their float32 values up to the longest caption (the images'
    cast is caption_strips'; render_strips casts and cuts the maps itself)."""
    images, alphas, words = batch
    short = [w[:3] for w in words]  # longest caption: 3 of the 5 steps
    half = alphas.bfloat16()
    points = alphas.argmax(-1)
    full, strips = caption_strips(images.bfloat16(), half, (4, 4), short, points=points)
    expected = render_strips(images.bfloat16().float(), half[:, :3].float(), (4, 4), short,
                             points=points[:, :3])
    assert torch.equal(full, expected) and full.shape[2] == W * 4
    assert [s.shape[1] for s in strips] == [W * (len(w) + 1) for w in short]
    assert all(torch.equal(s, full[i, :, : s.shape[1]]) for i, s in enumerate(strips))


def test_input_validation(batch) -> None:
    images, alphas, words = batch
    with pytest.raises(ValueError, match="steps"):
        render_strips(images, alphas[:, :2], (4, 4), words)
    with pytest.raises(ValueError, match="alphas"):
        render_strips(images, alphas, (3, 3), words)
    with pytest.raises(ValueError, match="captions"):
        render_strips(images, alphas, (4, 4), words[:2])
    with pytest.raises(ValueError, match="upsample"):
        render_strips(images, alphas, (4, 4), words, upsample="nearest")


def test_no_words_gives_only_the_image(batch) -> None:
    images, alphas, words = batch
    out = render_strips(images, alphas, (4, 4), [[], [], []])
    assert out.shape == (3, H + LH, W, 3)
    full = render_strips(images, alphas, (4, 4), words)
    assert torch.equal(out, full[:, :, :W])  # the first panel of the strip, and nothing else


def test_save_strip_png_roundtrip(tmp_path, batch) -> None:
    images, alphas, words = batch
    strip = render_strips(images, alphas, (4, 4), words)[0]
    path = save_strip_png(strip, tmp_path / "sub" / "strip.png")
    with Image.open(path) as im:
        assert im.mode == "RGB"
        assert torch.equal(torch.from_numpy(np.asarray(im).copy()), strip)
    with pytest.raises(ValueError):
        save_strip_png(strip.float(), tmp_path / "bad.png")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_matches_cpu(batch) -> None:
    images, alphas, words = batch
    points = alphas.argmax(-1)
    cpu = render_strips(images, alphas, (4, 4), words, points=points)
    gpu = render_strips(images.cuda(), alphas.cuda(), (4, 4), words, points=points.cuda())
    assert gpu.device.type == "cuda"
    assert (gpu.cpu().int() - cpu.int()).abs().max() <= 1


@pytest.mark.parametrize("mode", ["bicubic", "gaussian"])
def test_uniform_attention_is_flat_not_noise(mode: str) -> None:
    black = normalise(torch.zeros(1, 3, H, W))
    out = render_strips(black, torch.full((1, 1, 49), 1 / 49), (7, 7), [["w"]], upsample=mode)
    p = panel(out, 0, 1)
    cold = (viz.viridis_lut()[0] * 127.5).floor().int()
    assert (p == cold).all()  # one colour: the low end, no amplified rounding noise
