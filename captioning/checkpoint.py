"""Checkpoints: key names, the safe reader, fit checks, key maps for older files,
and loading a trained captioner without Lightning.

Both the Lightning checkpoints written by training and the small inference files written by
`save_inference_checkpoint` are read with `torch.load(weights_only=True)`: only tensors and
plain data are unpickled, and a file whose pickle would import or call anything else is
refused before any of it runs. The vocabulary and the model config stored in the checkpoint
rebuild the model; the backbone is built without pretrained weights (no download), since
every weight comes from the checkpoint's state dict.

`load_checkpoint` also takes an exported model folder (`captioning export`,
`Captioner.save_pretrained`: safetensors weights and JSON, read with no pickle at all; see
`captioning.models.pretrained`); `is_pretrained_dir` tells one from a checkpoint file.

Files written before the decoding settings moved into `decode:` and the REINFORCE baselines
into the objective are read through `upgrade`, which maps their keys to today's.
"""

from __future__ import annotations

import logging
import os
import pickle
import re
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from captioning.atomic import write_atomic
from captioning.models.captioner import Captioner, CaptionerConfig, DecodeConfig
from captioning.models.pretrained import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    PretrainedError,
    vocab_size_mismatch,
)
from captioning.models.pretrained import is_pretrained_dir as is_pretrained_dir  # re-exported
from captioning.vocab import Vocabulary

log = logging.getLogger(__name__)

#: Keys the LightningModule adds to every checkpoint it saves.
CHECKPOINT_VOCAB_KEY = "captioning_vocab"
CHECKPOINT_CONFIG_KEY = "captioning_model_config"
CHECKPOINT_RNG_KEY = "captioning_rng_states"
#: Prefix of the captioner's weights in the checkpoint's "state_dict".
STATE_PREFIX = "captioner."
INFERENCE_FORMAT = "captioning-inference"
#: `ckpt_path` values Lightning resolves itself (not file paths).
SPECIAL_CKPT_PATHS = frozenset({"last", "best", "hpc", "registry"})
#: Keys of every Lightning checkpoint, and those that resuming `fit` also needs.
LIGHTNING_KEYS = ("pytorch-lightning_version", "state_dict")
RESUME_KEYS = ("optimizer_states", "loops")
CHECKPOINT_SUFFIX = ".ckpt"

#: Older flat decoding hyperparameters -> fields of `DecodeConfig` (hyper_parameters["decode"]).
LEGACY_DECODE_KEYS = {"eval_strategy": "strategy", "beam_size": "beam_size",
                      "max_len": "max_len", "length_penalty": "length_penalty",
                      "forbid_unk": "forbid_unk"}
#: `model.net` fields newer than some checkpoints, with the value those were trained with: set
#: on reading, so that no flag changes the network (no new weights: a strict load sees none).
NET_FIELDS_ADDED = {"score": "additive", "n_layers_att": 1, "n_layers_init": 1,
                    "normalizer": "softmax", "output_tanh": False, "weight_init": "torch"}
#: Older state_dict prefixes -> today's (the REINFORCE baselines moved into the objective).
STATE_KEY_MAP = {"baseline.": "objective.baseline.",
                 "token_baseline.": "objective.token_baseline."}


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
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    path: Path | None = None


def read_checkpoint(path: str | os.PathLike[str], map_location: Any = "cpu", *,
                    mmap: bool = False) -> dict[str, Any]:
    """torch.load with weights_only=True; every failure becomes a CheckpointError.

    With `mmap` the tensors stay on disk (only the pickle is parsed). Either way every byte is
    read once against the file's checksums first (`_check_checksums`).
    """
    path = Path(path)
    if not path.exists():
        raise CheckpointNotFoundError(f"{path}: checkpoint file does not exist")
    if not path.is_file():
        raise CheckpointError(f"{path}: is not a file")
    _check_checksums(path)  # before loading; with `mmap` too (a resume's check)
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


def _check_checksums(path: Path) -> None:
    """A zip-format checkpoint's entries against their stored CRC-32s: `torch.load` does not
    check them, so a flipped bit in a tensor's bytes would load as a silently wrong weight.
    Reads every byte once. Entries saved without a checksum (CRC 0, `torch.serialization.
    set_crc32_options(False)`) and the legacy format, which has none, are not checked."""
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":  # torch's own test for its zip format
                return
        with zipfile.ZipFile(path) as z:
            for info in z.infolist():
                if info.CRC == 0 and info.file_size > 0:
                    continue
                try:
                    with z.open(info) as entry:  # raises at the end on a CRC mismatch
                        while entry.read(1 << 24):
                            pass
                except zipfile.BadZipFile:
                    raise CheckpointError(
                        f"{path}: corrupt checkpoint: the bytes of {info.filename} do not match "
                        "their stored checksum (a damaged or partly overwritten file)") from None
    except (zipfile.BadZipFile, OSError, EOFError) as e:
        raise CheckpointError(f"{path}: not a readable PyTorch checkpoint ({e})") from None


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


def check_checkpoint_file(ckpt_path: str | os.PathLike[str] | None, *, resume: bool = False
                          ) -> dict[str, Any] | None:
    """Refuse, before Lightning opens it, a checkpoint that is missing, unreadable (truncated),
    unsafe (its pickle would run code) or not a Lightning training checkpoint (`resume`: one
    with the training state `fit` restores); returns its contents with the tensors left on
    disk (`mmap`), or None for Lightning's special values ("last", "best", ...) and URLs.

    The error names the file and what is wrong with it, and the newest good checkpoint in the
    same folder when there is one (it is named, never used in its place)."""
    text = "" if ckpt_path is None else str(ckpt_path)
    if not text or text in SPECIAL_CKPT_PATHS or "://" in text or text.startswith("registry:"):
        return None
    path = Path(text)
    try:
        data = read_checkpoint(path, "cpu", mmap=True)
        check_trainer_checkpoint(path, data, resume=resume)
    except CheckpointNotFoundError:
        raise
    except CheckpointError as e:
        older = older_good_checkpoint(path, resume=resume)
        if older is None:
            raise
        raise CheckpointError(f"{e}; an older good checkpoint exists: {older[0]} "
                              f"({checkpoint_summary(older[1])}); pass `--ckpt_path "
                              f"{older[0]}` to use it") from None
    return data


def check_trainer_checkpoint(path: Path, data: Mapping[str, Any], *, resume: bool) -> None:
    """Refuse what Lightning cannot restore: a plain `torch.save({...})` dict, the project's
    inference checkpoint, or (`resume`) a weights-only checkpoint."""
    if data.get("format") == INFERENCE_FORMAT:
        raise CheckpointError(
            f"{path}: is an inference checkpoint (weights, vocabulary and config), not a "
            "Lightning training checkpoint; use it with `captioning caption` or `captioning "
            "predict`, or give --ckpt_path the training checkpoint it came from")
    missing = [k for k in LIGHTNING_KEYS if k not in data]
    if missing:
        raise CheckpointError(f"{path}: is not a Lightning training checkpoint (it has no "
                              f"{' or '.join(map(repr, missing))})")
    missing = [k for k in RESUME_KEYS if resume and k not in data]
    if missing:
        raise CheckpointError(f"{path}: holds no training state to resume (no "
                              f"{' or '.join(map(repr, missing))}: saved with weights only?); "
                              "validate or test it, or resume from a full checkpoint")


def checkpoint_summary(data: Mapping[str, Any]) -> str:
    return f"epoch {data.get('epoch', '?')}, step {data.get('global_step', '?')}"


def older_good_checkpoint(path: Path, *, resume: bool) -> tuple[Path, dict[str, Any]] | None:
    """The newest other checkpoint (`*.ckpt`) in `path`'s folder that passes the checks."""
    if not path.parent.is_dir():
        return None
    others = [p for p in path.parent.glob(f"*{CHECKPOINT_SUFFIX}") if p.is_file() and p != path]
    for other in sorted(others, key=lambda p: p.stat().st_mtime, reverse=True):
        try:
            data = read_checkpoint(other, "cpu", mmap=True)
            check_trainer_checkpoint(other, data, resume=resume)
        except CheckpointError:
            continue
        return other, data
    return None


def upgrade_hparams(hparams: Mapping[str, Any]) -> dict[str, Any]:
    """Model hyperparameters of any version in today's layout (flat decoding keys -> decode)."""
    hp = dict(hparams)
    legacy = {new: hp.pop(old) for old, new in LEGACY_DECODE_KEYS.items() if old in hp}
    if legacy:
        hp["decode"] = {**legacy, **dict(hp.get("decode") or {})}
    if "compile" in hp:  # the per-step `compile: bool`, replaced by `fast_path`
        hp.setdefault("fast_path", "compile" if hp.pop("compile") else "auto")
    if isinstance(hp.get("net"), Mapping):  # the fields it predates, as it was trained
        hp["net"] = {**NET_FIELDS_ADDED, **hp["net"]}
    return hp


def upgrade(checkpoint: dict[str, Any], own_keys: set[str] | None = None) -> dict[str, Any]:
    """Map an older checkpoint's keys to today's, in place; returns it.

    State-dict keys move by `STATE_KEY_MAP`; with `own_keys` (the model's state-dict keys) a
    moved key the model does not have is dropped (a soft model has no REINFORCE baseline).
    """
    if isinstance(checkpoint.get("hyper_parameters"), Mapping):
        checkpoint["hyper_parameters"] = upgrade_hparams(checkpoint["hyper_parameters"])
    state = checkpoint.get("state_dict")
    if not isinstance(state, dict):
        return checkpoint
    for key in list(state):
        old = next((p for p in STATE_KEY_MAP if key.startswith(p)), None)
        if old is None:
            continue
        new = STATE_KEY_MAP[old] + key[len(old):]
        value = state.pop(key)
        if own_keys is None or new in own_keys:
            state[new] = value
    return checkpoint


def _decode_settings(data: dict[str, Any]) -> DecodeConfig:
    hp = upgrade_hparams(data.get("hyper_parameters") or {})
    try:
        return DecodeConfig.from_dict(dict(hp.get("decode") or {}))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"invalid decoding settings: {e}") from None


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
    problem = vocab_size_mismatch(vocab, config.vocab_size, state)
    if problem:
        raise CheckpointError(f"{path}: {problem}")


def load_checkpoint(path: str | os.PathLike[str], *, map_location: Any = "cpu") -> LoadedModel:
    """Rebuild the captioner of a Lightning or inference checkpoint, or of an exported model
    folder (eval mode).

    Raises `CheckpointError` (a `ValueError`) naming the file when it is missing, unreadable,
    would run code when unpickled, or lacks / mismatches its vocabulary, config or weights.
    """
    path = Path(path)
    if path.is_dir():
        return _load_folder(path, map_location)
    data = read_checkpoint(path, map_location)
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


def _load_folder(path: Path, map_location: Any) -> LoadedModel:
    """`load_checkpoint` of an exported model folder (safetensors and JSON, no pickle)."""
    if not any((path / name).exists() for name in (CONFIG_FILE, WEIGHTS_FILE)):
        raise CheckpointError(f"{path}: is not a file, nor an exported model folder (it has no "
                              f"{CONFIG_FILE} or {WEIGHTS_FILE})")
    try:
        captioner = Captioner.from_pretrained(path)
    except PretrainedError as e:
        raise CheckpointError(str(e)) from None
    if isinstance(map_location, str | torch.device):
        captioner.to(map_location)
    assert captioner.vocab is not None  # from_pretrained sets it
    log.debug("loaded %s (%s, vocabulary %d)", path, captioner.config.attention,
              len(captioner.vocab))
    return LoadedModel(captioner, captioner.vocab, captioner.config, captioner.decode, path)


def save_inference_checkpoint(path: str | os.PathLike[str], captioner: Captioner,
                              vocab: Vocabulary, decode: DecodeConfig = DecodeConfig()) -> Path:
    """Write a small plain-data checkpoint (weights, vocabulary, config, decoding settings)
    that `load_checkpoint` reads; parent folders are created."""
    if len(vocab) != captioner.config.vocab_size:
        raise ValueError(f"vocabulary has {len(vocab)} words but the model was built for "
                         f"{captioner.config.vocab_size}")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {STATE_PREFIX + k: v.detach().cpu() for k, v in captioner.state_dict().items()}
    checkpoint = {
        "format": INFERENCE_FORMAT,
        "format_version": 1,
        "state_dict": state,
        "hyper_parameters": {"decode": decode.to_dict()},
        CHECKPOINT_VOCAB_KEY: vocab.to_dict(),
        CHECKPOINT_CONFIG_KEY: captioner.config.to_dict(),
    }
    return write_atomic(path, lambda tmp: torch.save(checkpoint, tmp))  # never half-written


def check_fits(checkpoint: Mapping[str, Any], *, state: Mapping[str, torch.Tensor],
               config: CaptionerConfig, vocab: Vocabulary | None, strict: bool = True) -> None:
    """Refuse, with the differences spelled out, a checkpoint whose vocabulary is not `vocab`
    or whose weights do not fit a model with state dict `state` and `config`."""
    if CHECKPOINT_VOCAB_KEY in checkpoint and vocab is not None:
        saved = Vocabulary.from_dict(checkpoint[CHECKPOINT_VOCAB_KEY])
        if saved != vocab:
            lacking = [w for w in saved.itos if w not in set(vocab.itos)]
            how = (f"{len(lacking)} of its words are not in the data's, e.g. "
                   f"{', '.join(map(repr, lacking[:3]))}" if lacking else
                   "the same words in another order")
            raise CheckpointError(
                f"the checkpoint's vocabulary ({len(saved)} words) is not the data's "
                f"({len(vocab)} words: {how}); resume or evaluate with the vocabulary the "
                "model was trained with (data.vocab_path)")
    theirs = checkpoint.get("state_dict")
    if not isinstance(theirs, Mapping):
        return
    problems = [f"{k}: checkpoint {tuple(v.shape)}, model {tuple(state[k].shape)}"
                for k, v in theirs.items() if k in state and hasattr(v, "shape")
                and tuple(v.shape) != tuple(state[k].shape)]
    if strict:
        problems += [f"{k}: missing from the checkpoint" for k in state if k not in theirs]
        problems += [f"{k}: not in this model" for k in theirs if k not in state]
    if not problems:
        return
    raw = checkpoint.get(CHECKPOINT_CONFIG_KEY) or \
        (checkpoint.get("hyper_parameters") or {}).get("net")
    if isinstance(raw, dict):
        diff = [f"{k}={raw[k]!r} (this model {v!r})"
                for k, v in config.to_dict().items() if k in raw and raw[k] != v]
        detail = "; checkpoint model config " + (", ".join(diff) if diff else "matches")
    else:
        detail = "; the checkpoint has no captioning model config"
    raise CheckpointError(
        f"the checkpoint's weights do not fit this model ({len(problems)} tensors, first: "
        f"{'; '.join(problems[:3])}){detail}")
