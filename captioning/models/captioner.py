"""Captioner = CNN encoder + attention LSTM decoder, with `forward` and `generate`."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Literal

from torch import Tensor, nn

from captioning.decoding import Generation, SpecialIds, beam_search, greedy_search
from captioning.models.attention import WeightRule
from captioning.models.decoder import (
    AttentionKind,
    AttentionLSTMDecoder,
    DecoderOutput,
    SemiSampling,
)
from captioning.models.encoder import CNNEncoder

Strategy = Literal["greedy", "beam"]


@dataclass(frozen=True)
class CaptionerConfig:
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

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CaptionerConfig:
        if not isinstance(data, dict):
            raise ValueError(f"model config must be a dict, got {type(data).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ValueError(f"model config has unknown fields {unknown}")
        return cls(**data)


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
        """(B, 3, H, W) images -> (B, L, D) annotations; (B, L, D) cached features pass through."""
        return images if images.dim() == 3 else self.encoder(images)

    def forward(self, images: Tensor, captions: Tensor, lengths: Tensor) -> DecoderOutput:
        """Teacher-forced pass: captions (B, T+1) start with <start>; lengths include specials."""
        return self.decoder(self.encode(images), captions, lengths)

    def generate(
        self,
        images: Tensor,
        *,
        strategy: Strategy = "beam",
        beam_size: int = 3,
        max_len: int = 20,
        length_penalty: float = 0.0,
        forbid_unk: bool = False,
    ) -> Generation:
        """Decode captions; call in eval mode. Hard models use their configured context rule."""
        features = self.encode(images)
        if strategy == "greedy":
            return greedy_search(self.decoder, features, max_len=max_len, forbid_unk=forbid_unk)
        if strategy == "beam":
            if length_penalty < 0:
                raise ValueError(f"length_penalty must be >= 0, got {length_penalty}")
            return beam_search(self.decoder, features, beam_size=beam_size, max_len=max_len,
                               length_penalty=length_penalty, forbid_unk=forbid_unk)
        raise ValueError(f"unknown decoding strategy {strategy!r}; use 'greedy' or 'beam'")
