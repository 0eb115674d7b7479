"""Pure-torch model: encoder, attention, decoder, decoding, captioner."""

from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.decoder import AttentionLSTMDecoder, DecoderOutput
from captioning.models.decoding import Generation, SpecialIds
from captioning.models.encoder import BACKBONES, CNNEncoder
from captioning.models.state import DecoderState, Memory

__all__ = [
    "BACKBONES",
    "AttentionLSTMDecoder",
    "CNNEncoder",
    "Captioner",
    "CaptionerConfig",
    "DecodeConfig",
    "DecoderOutput",
    "DecoderState",
    "Generation",
    "Memory",
    "SpecialIds",
]
