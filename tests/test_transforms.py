"""The eval transform's geometry: boxes mapped into the model input."""

from __future__ import annotations

import pytest
import torch

from captioning.data.transforms import boxes_to_crop_coords


def test_boxes_to_crop_coords_geometry() -> None:
    # landscape 200x100: the visible square is x in [50, 150]
    assert boxes_to_crop_coords([50, 0, 100, 100], 200, 100) == pytest.approx((0, 0, 1, 1))
    assert boxes_to_crop_coords([100, 25, 20, 50], 200, 100) == pytest.approx(
        (0.5, 0.25, 0.2, 0.5))
    assert boxes_to_crop_coords([0, 0, 40, 40], 200, 100)[2] == 0  # outside the crop
    assert boxes_to_crop_coords([40, 10, 20, 10], 200, 100) == pytest.approx(
        (0, 0.1, 0.1, 0.1))  # clipped at the left edge
    # portrait 100x300: the visible square is y in [100, 200]
    assert boxes_to_crop_coords([10, 150, 20, 20], 100, 300) == pytest.approx(
        (0.1, 0.5, 0.2, 0.2))


@pytest.mark.parametrize(("width", "height", "bbox"), [
    (333, 200, [150, 40, 60, 90]), (180, 301, [20, 140, 50, 33]), (64, 64, [8, 9, 10, 11])])
def test_boxes_to_crop_coords_matches_torchvision(width, height, bbox) -> None:
    from torchvision import transforms

    size = 96
    mask = torch.zeros(1, height, width)
    x, y, w, h = bbox
    mask[:, y : y + h, x : x + w] = 1.0
    tf = transforms.Compose([transforms.Resize(size, antialias=False), transforms.CenterCrop(size)])
    out = tf(mask)[0] > 0.5
    ys, xs = out.any(1).nonzero().flatten(), out.any(0).nonzero().flatten()
    got = torch.tensor(boxes_to_crop_coords(bbox, width, height, size=size)) * size
    expected = torch.tensor([xs.min(), ys.min(), xs.max() + 1 - xs.min(), ys.max() + 1 - ys.min()])
    assert (got - expected.float()).abs().max() <= 1.0
    loose = torch.tensor(boxes_to_crop_coords(bbox, width, height)) * size
    assert (loose - expected.float()).abs().max() <= 1.5


def test_model_input_reads_a_file_and_its_pil_image_alike(tmp_path) -> None:
    """`model_input` of an EXIF-rotated JPEG equals that of the same file opened with PIL by
    hand (whose orientation PIL does not apply), and differs from the unrotated pixels."""
    import numpy as np
    from PIL import Image

    from captioning.data.transforms import model_input, model_inputs

    im = Image.new("RGB", (200, 100), (0, 0, 255))  # large enough to decode at half scale
    im.paste((255, 0, 0), (0, 0, 50, 100))  # a red band on the left
    im.paste((0, 255, 0), (60, 40, 70, 50))  # fine detail, where the scales differ
    exif = Image.Exif()
    exif[0x0112] = 6  # rotate 90° clockwise on display
    path = tmp_path / "rotated.jpg"
    im.save(path, format="JPEG", quality=95, exif=exif.tobytes())
    from_file = model_input(path, 32)
    with Image.open(path) as opened:
        assert torch.equal(model_input(opened, 32), from_file)
    with Image.open(path) as opened:
        opened.load()  # decoded in full by hand first: not the file's reduced decoding
        plain = Image.fromarray(np.asarray(opened))  # the same pixels, no EXIF: not rotated
        assert not torch.equal(model_input(plain, 32), from_file)
        assert not torch.equal(model_input(opened, 32), from_file)
    assert from_file.shape == (3, 32, 32)
    assert torch.equal(model_inputs([path, path], 32), torch.stack([from_file, from_file]))
