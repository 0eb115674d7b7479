"""Load a trained captioner from a checkpoint, safely and without Lightning.

Both the Lightning checkpoints written by training and the small inference files written by
`save_inference_checkpoint` are read with `torch.load(weights_only=True)`: only tensors and
plain data are unpickled, and a file whose pickle would import or call anything else is
refused before any of it runs. The vocabulary and the model config stored in the checkpoint
rebuild the model; the backbone is built without pretrained weights (no download), since
every weight comes from the checkpoint's state dict.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from captioning.models.captioner import Captioner, CaptionerConfig
from captioning.vocab import Vocabulary

log = logging.getLogger(__name__)

#: Checkpoint keys written by `CaptioningModule.on_save_checkpoint` (same strings).
CHECKPOINT_VOCAB_KEY = "captioning_vocab"
CHECKPOINT_CONFIG_KEY = "captioning_model_config"
#: Prefix of the captioner's weights in the checkpoint's "state_dict".
STATE_PREFIX = "captioner."
#: Decoding settings read from the checkpoint's "hyper_parameters", with their defaults.
DECODE_DEFAULTS: dict[str, Any] = {"eval_strategy": "beam", "beam_size": 3, "max_len": 20,
                                   "length_penalty": 0.0, "forbid_unk": False}
INFERENCE_FORMAT = "captioning-inference"


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, refused as unsafe or inconsistent."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """The checkpoint file does not exist."""


@dataclass
class LoadedModel:
    """A captioner rebuilt from a checkpoint, in eval mode, with what is needed to decode."""

    captioner: Captioner
    vocab: Vocabulary
    config: CaptionerConfig
    decode: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None


def _read(path: Path, map_location: Any, *, mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True; every failure becomes a CheckpointError.

    With `mmap` the tensors stay on disk (only the pickle is parsed), for a cheap safety check.
    """
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: checkpoint file does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path}: is not a file")
    try:
        try:
            data = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
        except RuntimeError as e:
            if not mmap or "mmap" not in str(e):
                raise
            data = torch.load(path, map_location=map_location, weights_only=True)  # legacy format
    except pickle.UnpicklingError as e:
        found = re.search(r"Unsupported global: GLOBAL (\S+)", str(e))
        if found:
            raise CheckpointError(
                f"{path}: refused to load: its pickle would import and call {found.group(1)}, "
                "which can run arbitrary code (only tensors and plain data are accepted; "
                "nothing from the file was run). If you trust its source, load it with "
                "torch.load(weights_only=False) yourself and re-save the model with "
                "captioning.checkpoint.save_inference_checkpoint") from None
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint "
                              f"({_first_reason(str(e))})") from None
    except MemoryError:
        raise
    except Exception as e:  # the many ways a corrupt or foreign file fails to unpickle
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint "
                              f"({type(e).__name__}: {_first_reason(str(e))})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a checkpoint dict, got {type(data).__name__}")
    return data


def _first_reason(message: str) -> str:
    """The informative part of torch's long unpickling messages."""
    found = re.search(r"WeightsUnpickler error:\s*(\S[^\n]*)", message)
    if found:
        return found.group(1).strip()
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    return lines[0][:200] if lines else "unknown error"


def _vocab(path: Path, data: dict[str, Any]) -> Vocabulary:
    if CHECKPOINT_VOCAB_KEY not in data:
        raise CheckpointError(
            f"{path}: the checkpoint has no vocabulary ({CHECKPOINT_VOCAB_KEY!r}); it was "
            "saved without a data module, so its words are unknown and it cannot caption")
    try:
        return Vocabulary.from_dict(data[CHECKPOINT_VOCAB_KEY])
    except ValueError as e:
        raise CheckpointError(f"{path}: invalid vocabulary: {e}") from None


def _config(path: Path, data: dict[str, Any]) -> CaptionerConfig:
    raw = data.get(CHECKPOINT_CONFIG_KEY)
    if raw is None:  # older checkpoints: the model hyperparameters hold the same dict
        raw = (data.get("hyper_parameters") or {}).get("net")
    if raw is None:
        raise CheckpointError(f"{path}: the checkpoint has no model config "
                              f"({CHECKPOINT_CONFIG_KEY!r}); cannot rebuild the model")
    try:
        return CaptionerConfig.from_dict(raw)
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: invalid model config: {e}") from None


def _decode_settings(data: dict[str, Any]) -> dict[str, Any]:
    hp = data.get("hyper_parameters") or {}
    return {k: hp.get(k, default) for k, default in DECODE_DEFAULTS.items()}


def _captioner_state(path: Path, data: dict[str, Any]) -> dict[str, torch.Tensor]:
    state = data.get("state_dict")
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: the checkpoint has no 'state_dict'")
    sub = {k[len(STATE_PREFIX):]: v for k, v in state.items() if k.startswith(STATE_PREFIX)}
    if not sub:
        raise CheckpointError(f"{path}: the state_dict holds no {STATE_PREFIX!r} weights")
    return sub


def _check_sizes(path: Path, vocab: Vocabulary, config: CaptionerConfig,
                 state: dict[str, torch.Tensor]) -> None:
    sizes = {"vocabulary": len(vocab), "model config vocab_size": config.vocab_size}
    embed = state.get("decoder.embed.weight")
    if embed is not None:
        sizes["embedding rows"] = int(embed.shape[0])
    if len(set(sizes.values())) > 1:
        detail = ", ".join(f"{k} {v}" for k, v in sizes.items())
        raise CheckpointError(f"{path}: vocabulary size mismatch ({detail}); the vocabulary "
                              "does not belong to these weights")


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> LoadedModel:
    """Rebuild the captioner of a Lightning or inference checkpoint (eval mode).

    Raises `CheckpointError` (a `ValueError`) naming the file when it is missing, unreadable,
    would run code when unpickled, or lacks / mismatches its vocabulary, config or weights.
    """
    path = Path(path)
    data = _read(path, map_location)
    vocab = _vocab(path, data)
    config = _config(path, data)
    state = _captioner_state(path, data)
    _check_sizes(path, vocab, config, state)
    try:
        captioner = Captioner(replace(config, weights=None))  # the weights come from `state`
        captioner.load_state_dict(state, strict=True)
    except (RuntimeError, ValueError, KeyError) as e:
        raise CheckpointError(f"{path}: the weights do not fit the model config: "
                              f"{str(e).strip().splitlines()[0][:300]}") from None
    captioner.eval()
    log.debug("loaded %s (%s, vocabulary %d)", path, config.attention, len(vocab))
    return LoadedModel(captioner, vocab, config, _decode_settings(data), path)


def save_inference_checkpoint(path: str | os.PathLike[str], captioner: Captioner,
                              vocab: Vocabulary, decode: dict[str, Any] | None = None) -> Path:
    """Write a small plain-data checkpoint (weights, vocabulary, config, decoding settings)
    that `load_checkpoint` reads; parent folders are created."""
    if len(vocab) != captioner.config.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab)} words but the model was built for "
                         f"{captioner.config.vocab_size}")
    unknown = sorted(set(decode or {}) - set(DECODE_DEFAULTS))
    if unknown:
        raise ValueError(f"unknown decoding settings {unknown}; use {sorted(DECODE_DEFAULTS)}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {STATE_PREFIX + k: v.detach().cpu() for k, v in captioner.state_dict().items()}
    torch.save({
        "format": INFERENCE_FORMAT,
        "format_version": 1,
        "state_dict": state,
        "hyper_parameters": {**DECODE_DEFAULTS, **(decode or {})},
        CHECKPOINT_VOCAB_KEY: vocab.to_dict(),
        CHECKPOINT_CONFIG_KEY: captioner.config.to_dict(),
    }, path)
    return path
