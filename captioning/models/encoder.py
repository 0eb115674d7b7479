"""CNN encoder: a torchvision backbone turned into an L×D grid of annotation vectors (§3.1.1)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackboneSpec:
    """How to build a backbone and cut it at the annotation layer."""

    builder: str  # torchvision.models function name
    weights_enum: str  # torchvision weights enum name
    dim: int  # channels D of the annotation vectors
    stride: int  # input pixels per grid cell
    cut: Callable[[nn.Module], nn.Module]
    pools_down: bool = False  # unpadded max-pools drop an odd last row (VGG); else padded

    def side(self, image_size: int) -> int:
        """Grid cells per side for a square input of `image_size` pixels."""
        return image_size // self.stride if self.pools_down else -(-image_size // self.stride)


def _vgg_conv5_4(m: nn.Module) -> nn.Module:
    # features[:36] ends with conv5_4 + ReLU, before the last max-pool: 14×14×512 at 224 px,
    # the paper's annotation layer.
    return m.features[:36]


def _resnet_layer4(m: nn.Module) -> nn.Module:
    return nn.Sequential(m.conv1, m.bn1, m.relu, m.maxpool, m.layer1, m.layer2, m.layer3, m.layer4)


def _mobilenet_last(m: nn.Module) -> nn.Module:
    return m.features


def _mobilenet_s16(m: nn.Module) -> nn.Module:
    # Through the 96-channel block at stride 16: a finer grid with colour still present.
    return m.features[:14]


BACKBONES: dict[str, BackboneSpec] = {
    "vgg19": BackboneSpec("vgg19", "VGG19_Weights", 512, 16, _vgg_conv5_4, pools_down=True),
    "resnet50": BackboneSpec("resnet50", "ResNet50_Weights", 2048, 32, _resnet_layer4),
    "resnet101": BackboneSpec("resnet101", "ResNet101_Weights", 2048, 32, _resnet_layer4),
    "resnet18": BackboneSpec("resnet18", "ResNet18_Weights", 512, 32, _resnet_layer4),
    "mobilenet_v2": BackboneSpec("mobilenet_v2", "MobileNet_V2_Weights", 1280, 32, _mobilenet_last),
    "mobilenet_v2_s16": BackboneSpec("mobilenet_v2", "MobileNet_V2_Weights", 96, 16, _mobilenet_s16),
}


def build_backbone(name: str, weights: str | None) -> nn.Module:
    """A torchvision model with ImageNet weights from the weights API, a local file, or none.

    `weights` is None (random init), a torchvision enum member name such as "DEFAULT" or
    "IMAGENET1K_V1" (read from $TORCH_HOME/hub/checkpoints when cached), or a path to a
    state_dict file of the full torchvision model (for offline clusters).
    """
    import torchvision.models as tvm

    if name not in BACKBONES:
        raise ValueError(f"unknown backbone {name!r}; choose from {sorted(BACKBONES)}")
    spec = BACKBONES[name]
    builder = getattr(tvm, spec.builder)
    if weights is None or weights.lower() == "none":
        return builder(weights=None)
    path = Path(weights).expanduser()
    if path.suffix in {".pth", ".pt", ".bin"} or path.exists():
        if not path.is_file():
            raise FileNotFoundError(f"backbone weights file not found: {path}")
        model = builder(weights=None)
        state = torch.load(path, map_location="cpu", weights_only=True)
        if isinstance(state, dict) and "state_dict" in state:
            state = state["state_dict"]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if missing:
            raise ValueError(f"{path}: weights miss {len(missing)} keys of {name}, e.g. {missing[:3]}")
        if unexpected:
            log.warning("%s: ignored %d unexpected keys", path, len(unexpected))
        return model
    enum = getattr(tvm, spec.weights_enum)
    try:
        member = enum.DEFAULT if weights.upper() == "DEFAULT" else enum[weights]
    except KeyError as e:
        raise ValueError(f"unknown weights {weights!r} for {name}; use None, DEFAULT, "
                         f"{[m.name for m in enum]} or a file path") from e
    return _pretrained(builder, member, name)


class WeightsUnavailableError(FileNotFoundError):
    """Pretrained backbone weights are neither in the torch cache nor downloadable."""


def _pretrained(builder: Any, member: Any, name: str) -> nn.Module:
    """`builder(weights=member)`; a failed download becomes one line that names the weights,
    the file torchvision expects and the `weights: /path/to/file.pth` option."""
    target = Path(torch.hub.get_dir()) / "checkpoints" / Path(member.url).name
    try:
        return builder(weights=member)
    except OSError as e:  # urllib's URLError, timeouts, refused connections
        if target.is_file():
            raise
        reason = getattr(e, "reason", None) or e.strerror or e
        raise WeightsUnavailableError(
            f"backbone {name}: pretrained weights {type(member).__name__}.{member.name} are "
            f"not in {target.parent} and cannot be downloaded ({reason}); put "
            f"{target.name} there (or set $TORCH_HOME), or give the file with "
            "model.net.weights: /path/to/file.pth (weights: null trains from scratch)"
        ) from None


class CNNEncoder(nn.Module):
    """Image (B, 3, H, W) -> annotation grid (B, L, D), L = gh·gw (§3.1.1's a = {a_1..a_L})."""

    def __init__(
        self,
        *,
        backbone: str = "vgg19",
        weights: str | None = None,
        grid_size: int | None = 14,
        trainable: bool = False,
        channels_last: bool = False,
    ) -> None:
        super().__init__()
        model = build_backbone(backbone, weights)  # validates the name
        spec = BACKBONES[backbone]
        self.body = spec.cut(model)
        self.dim, self.spec = spec.dim, spec
        self.grid = grid_size
        self.pool = nn.AdaptiveAvgPool2d(grid_size) if grid_size else nn.Identity()
        self.trainable = trainable
        self.channels_last = channels_last
        if channels_last:
            self.body = self.body.to(memory_format=torch.channels_last)
        self.body.requires_grad_(trainable)
        if not trainable:
            self.body.eval()

    def train(self, mode: bool = True) -> CNNEncoder:
        super().train(mode)
        if not self.trainable:
            self.body.eval()  # frozen: BatchNorm statistics stay fixed
        return self

    def grid_shape(self, image_size: int) -> tuple[int, int]:
        """(gh, gw) of the grid for a square input of `image_size` pixels."""
        if self.grid:
            return (self.grid, self.grid)
        n = self.spec.side(image_size)
        return (n, n)

    def forward(self, images: Tensor) -> Tensor:
        if self.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.set_grad_enabled(self.trainable and torch.is_grad_enabled()):
            x = self.pool(self.body(images))  # (B, D, gh, gw)
        return x.flatten(2).transpose(1, 2).contiguous()  # (B, L, D)


def fingerprint(weights: nn.Module | dict[str, Tensor]) -> str:
    """A short hash of a module's weights (or of a state dict): feature caches are keyed by it."""
    import hashlib

    h = hashlib.sha256()
    state = weights if isinstance(weights, dict) else weights.state_dict()
    for name, t in sorted(state.items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]
