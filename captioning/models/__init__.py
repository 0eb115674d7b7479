"""Pure-torch model: encoder, attention, decoder, captioner."""

from captioning.models.captioner import Captioner, CaptionerConfig
from captioning.models.decoder import AttentionLSTMDecoder, DecoderOutput, DecoderState, Memory
from captioning.models.encoder import BACKBONES, CNNEncoder

__all__ = [
    "BACKBONES",
    "AttentionLSTMDecoder",
    "CNNEncoder",
    "Captioner",
    "CaptionerConfig",
    "DecoderOutput",
    "DecoderState",
    "Memory",
]
