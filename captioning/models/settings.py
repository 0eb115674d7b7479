"""The decoder's choices and their check, shared by `AttentionLSTMDecoder` and
`CaptionerConfig` (which names a refused setting `net.<name>`)."""

from __future__ import annotations

from typing import Literal

from captioning.choices import check_choice
from captioning.models.attention import Normalizer, WeightRule

AttentionKind = Literal["soft", "hard"]
SemiSampling = Literal["image", "batch"]
SemiSamplingGrad = Literal["paper", "detached"]
HardEstimator = Literal["reinforce", "gumbel"]


def check_settings(*, attention: str, hard_decode: str, semi_sampling: str,
                   semi_sampling_prob: float, semi_sampling_grad: str, hard_estimator: str,
                   n_layers_init: int, normalizer: str = "softmax") -> None:
    """Refuse a setting the decoder does not know, naming it (`CaptionerConfig` names it
    `net.<name>`)."""
    check_choice("attention", attention, AttentionKind)
    check_choice("hard_decode", hard_decode, WeightRule)
    check_choice("semi_sampling", semi_sampling, SemiSampling)
    check_choice("semi_sampling_grad", semi_sampling_grad, SemiSamplingGrad)
    check_choice("hard_estimator", hard_estimator, HardEstimator)
    if not 0.0 <= semi_sampling_prob <= 1.0:
        raise ValueError(f"semi_sampling_prob must be in [0, 1], got {semi_sampling_prob}")
    if n_layers_init < 1:
        raise ValueError(f"n_layers_init must be >= 1, got {n_layers_init}")
    check_choice("normalizer", normalizer, Normalizer)
    if normalizer != "softmax" and attention != "soft":
        raise ValueError(f"normalizer {normalizer!r} is for soft attention (hard attention "
                         "samples from softmax's α)")
