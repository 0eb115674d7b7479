"""Captioner = CNN encoder + attention LSTM decoder, with `forward` and `generate`.

`CaptionerConfig` (YAML `model.net`) rebuilds the network; `DecodeConfig` (YAML `model.decode`)
says how captions are decoded. Both are stored as plain dicts in checkpoints.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor, nn

from captioning.models.attention import WeightRule
from captioning.models.decoder import (
    AttentionKind,
    AttentionLSTMDecoder,
    DecoderOutput,
    SemiSampling,
)
from captioning.models.decoding import Generation, SpecialIds, beam_search, greedy_search
from captioning.models.encoder import CNNEncoder, fingerprint

Strategy = Literal["greedy", "beam"]
_Config = TypeVar("_Config", bound="_PlainConfig")


@dataclass(frozen=True)
class _PlainConfig:
    """A frozen dataclass that round-trips through a plain dict (checkpoints, JSON); a
    dataclass itself, so that jsonargparse parses its subclasses as plain nested options."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)  # type: ignore[call-overload]

    @classmethod
    def from_dict(cls: type[_Config], data: dict[str, Any]) -> _Config:
        if not isinstance(data, dict):
            raise ValueError(f"{cls.__name__} must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"{cls.__name__} has unknown fields {unknown}")
        return cls(**data)


@dataclass(frozen=True)
class DecodeConfig(_PlainConfig):
    """How captions are decoded: the one set of decoding settings (validation, test, the
    `caption` command, overlays). Hard-attention models also follow `net.hard_decode`."""

    strategy: Strategy = "beam"
    beam_size: int = 3
    max_len: int = 20
    length_penalty: float = 0.0  # rank finished beams by score / length^penalty
    forbid_unk: bool = False

    def __post_init__(self) -> None:
        if self.strategy not in ("greedy", "beam"):
            raise ValueError(f"decode.strategy must be 'greedy' or 'beam', got {self.strategy!r}")
        for name in ("beam_size", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"decode.{name} must be >= 1, got {getattr(self, name)}")
        if self.length_penalty < 0:
            raise ValueError(f"decode.length_penalty must be >= 0, got {self.length_penalty}")


@dataclass(frozen=True)
class CaptionerConfig(_PlainConfig):
    """Everything needed to rebuild a Captioner; stored as a plain dict in checkpoints."""

    vocab_size: int = 0
    backbone: str = "vgg19"
    weights: str | None = None
    grid_size: int | None = 14
    image_size: int = 224
    finetune_encoder: bool = False
    channels_last: bool = False
    embed_dim: int = 512
    hidden_dim: int = 512
    attn_dim: int = 512
    dropout: float = 0.5
    attention: AttentionKind = "soft"
    hard_decode: WeightRule = "expected"
    semi_sampling_prob: float = 0.5
    semi_sampling: SemiSampling = "image"


class Captioner(nn.Module):
    """Images (or cached annotation grids) in, captions and attention maps out."""

    def __init__(self, config: CaptionerConfig) -> None:
        super().__init__()
        if config.vocab_size <= len(SpecialIds.__dataclass_fields__):
            raise ValueError(f"vocab_size must exceed the 4 special tokens, got {config.vocab_size}")
        self.config = config
        self.encoder = CNNEncoder(
            backbone=config.backbone,
            weights=config.weights,
            grid_size=config.grid_size,
            trainable=config.finetune_encoder,
            channels_last=config.channels_last,
        )
        self.decoder = AttentionLSTMDecoder(
            vocab_size=config.vocab_size,
            feature_dim=self.encoder.dim,
            embed_dim=config.embed_dim,
            hidden_dim=config.hidden_dim,
            attn_dim=config.attn_dim,
            dropout=config.dropout,
            attention=config.attention,
            hard_decode=config.hard_decode,
            semi_sampling_prob=config.semi_sampling_prob,
            semi_sampling=config.semi_sampling,
        )

    @property
    def grid(self) -> tuple[int, int]:
        """(gh, gw) of the annotation grid."""
        return self.encoder.grid_shape(self.config.image_size)

    def encode(self, images: Tensor) -> Tensor:
        """(B, 3, H, W) images -> (B, L, D) annotations; (B, L, D) cached features pass through.

        Cached grids travel as float16 (half the bytes); compute starts from float32 here, the
        one place every consumer (training, decoding, benchmarks) goes through.
        """
        if images.dim() == 3:
            return images.float() if images.dtype == torch.float16 else images
        return self.encoder(images)

    def feature_cache_key(self) -> dict[str, Any]:
        """What cached annotation grids depend on besides the images and the input size."""
        cfg = self.config
        return {"backbone": cfg.backbone, "grid_size": cfg.grid_size,
                "channels_last": cfg.channels_last, "weights": fingerprint(self.encoder)}

    def forward(self, images: Tensor, captions: Tensor, lengths: Tensor) -> DecoderOutput:
        """Teacher-forced pass: captions (B, T+1) start with <start>; lengths include specials."""
        return self.decoder(self.encode(images), captions, lengths)

    def generate(self, images: Tensor, decode: DecodeConfig = DecodeConfig()) -> Generation:
        """Decode captions; call in eval mode. Hard models use their configured context rule."""
        features = self.encode(images)
        if decode.strategy == "greedy":
            return greedy_search(self.decoder, features, max_len=decode.max_len,
                                 forbid_unk=decode.forbid_unk)
        return beam_search(self.decoder, features, beam_size=decode.beam_size,
                           max_len=decode.max_len, length_penalty=decode.length_penalty,
                           forbid_unk=decode.forbid_unk)
