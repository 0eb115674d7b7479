"""Exported model folders: a captioner shared as safetensors weights and JSON, read with no
pickle at all.

A folder holds

* `model.safetensors`: the captioner's state dict (the names `Captioner.state_dict()` gives),
* `config.json`: `{"format": "captioning-pretrained", "format_version": 1,
  "model": <CaptionerConfig dict>, "decode": <DecodeConfig dict>, "training": <dict>,
  "trained_on": <dict>,
  "sha256": {"model.safetensors": <hex>, "vocab.json": <hex>, "config.json#model": <hex>}}`
  (`training`, optional: the run's loss settings, `captioning.objectives.LOSS_SETTINGS`;
  `trained_on`, optional: the data source its run read and the rule that carved val and test
  out of it, `{"source": <config>, "carving": <rule or null>}`, checked before its scores;
  `sha256`, optional in older folders: the files' digests and that of the `model` settings,
  checked on reading, so that a damaged or edited file is an error rather than wrong captions;
  `decode` may be edited),
* `vocab.json`: the vocabulary in `Vocabulary.save`'s format, so that
  `--data.vocab_path DIR/vocab.json` trains or evaluates with the same words,
* `README.md`: a model card.

Every file is written atomically (a temporary file in the folder, fsync, rename), and
`config.json` last, after an older one is removed first: a folder holding `config.json` and
`model.safetensors` is complete, whatever interrupted a write. This module reads and writes the
files and knows nothing of the model; `Captioner.save_pretrained` / `Captioner.from_pretrained`
build it, and `captioning.checkpoint.load_checkpoint` accepts a folder as well.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, TypeVar

from torch import Tensor, nn

from captioning.atomic import fsync_dir, remove_stale_temporaries, write_atomic
from captioning.vocab import Vocabulary

FORMAT = "captioning-pretrained"
FORMAT_VERSION = 1
WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE, CARD_FILE = \
    "model.safetensors", "config.json", "vocab.json", "README.md"
#: The key of the `model` settings' digest among config.json's "sha256" (`settings_digest`).
MODEL_DIGEST = f"{CONFIG_FILE}#model"
#: config.json's record of the data its run read: {"source": ..., "carving": ...}.
TRAINED_ON = "trained_on"
#: The files `read_model_folder` needs, in the order they are checked.
REQUIRED_FILES = (CONFIG_FILE, WEIGHTS_FILE, VOCAB_FILE)
#: The decoder's word embedding in a captioner's state dict: one row per vocabulary word.
EMBEDDING_KEY = "decoder.embed.weight"

_T = TypeVar("_T")


def vocab_size_mismatch(vocab: Vocabulary, vocab_size: int, state: Mapping[str, Tensor]
                        ) -> str | None:
    """What is wrong when the vocabulary, the config's `vocab_size` and the embedding's rows
    (`EMBEDDING_KEY` in `state`) are not one size; None when they are."""
    sizes = {"vocabulary": len(vocab), "model config vocab_size": vocab_size}
    if EMBEDDING_KEY in state:
        sizes["embedding rows"] = int(state[EMBEDDING_KEY].shape[0])
    if len(set(sizes.values())) == 1:
        return None
    detail = ", ".join(f"{k} {v}" for k, v in sizes.items())
    return f"vocabulary size mismatch ({detail}); the vocabulary does not belong to these weights"


class PretrainedError(ValueError):
    """An exported model folder is missing, incomplete, unreadable or inconsistent; the
    message is one line and names the file."""


def is_pretrained_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a (complete) exported model folder: config.json + model.safetensors."""
    path = Path(path)
    return path.is_dir() and (path / CONFIG_FILE).is_file() and (path / WEIGHTS_FILE).is_file()


@dataclass
class ModelFolder:
    """The contents of an exported model folder, as plain data and CPU tensors."""

    path: Path
    model: dict[str, Any]  # the CaptionerConfig dict
    decode: dict[str, Any]  # the DecodeConfig dict
    vocab: Vocabulary
    state: dict[str, Tensor]
    training: dict[str, Any] = field(default_factory=dict)  # the run's loss settings, if known
    trained_on: dict[str, Any] = field(default_factory=dict)  # its run's data source, carving

    def config(self, key: Literal["model", "decode"], parse: Callable[[dict[str, Any]], _T]) -> _T:
        """`parse(self.model)` or `parse(self.decode)`; a refusal names config.json."""
        try:
            return parse(dict(getattr(self, key)))
        except (TypeError, ValueError) as e:
            what = "model config" if key == "model" else "decoding settings"
            raise PretrainedError(f"{self.path / CONFIG_FILE}: invalid {what} ({key!r}): "
                                  f"{_one_line(e)}") from None

    def check_vocab_size(self, vocab_size: int) -> None:
        """Refuse a vocabulary that is not the size of the model's (`vocab_size` from the
        config, and the embedding's rows)."""
        problem = vocab_size_mismatch(self.vocab, vocab_size, self.state)
        if problem:
            raise PretrainedError(f"{self.path / VOCAB_FILE}: {problem}")

    def load_into(self, module: nn.Module) -> None:
        """Load the weights into `module`, all of them and nothing else (strict)."""
        own = module.state_dict()
        missing = [k for k in own if k not in self.state]
        unexpected = [k for k in self.state if k not in own]
        shapes = [f"{k} {tuple(v.shape)} vs model {tuple(own[k].shape)}"
                  for k, v in self.state.items() if k in own and v.shape != own[k].shape]
        problems = [f"{len(names)} {what}: {_first(names)}" for what, names in
                    (("missing", missing), ("unexpected", unexpected),
                     ("of another shape", shapes)) if names]
        file = self.path / WEIGHTS_FILE
        if problems:
            raise PretrainedError(f"{file}: the weights do not fit the model config "
                                  f"({'; '.join(problems)})")
        try:
            module.load_state_dict(self.state, strict=True)
        except (RuntimeError, ValueError) as e:
            raise PretrainedError(f"{file}: the weights do not fit the model config: "
                                  f"{_one_line(e)}") from None


def _one_line(e: BaseException) -> str:
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return (lines[0] if lines else type(e).__name__)[:300]


def _first(names: Sequence[str], n: int = 3) -> str:
    return ", ".join(names[:n]) + (f", ... ({len(names) - n} more)" if len(names) > n else "")


# -- reading ------------------------------------------------------------------------------------
def read_model_folder(path: str | os.PathLike[str]) -> ModelFolder:
    """Read an exported model folder with `json` and `safetensors` (no pickle); raises
    `PretrainedError` naming the file that is missing, unreadable or wrong."""
    path = Path(path)
    if not path.exists():
        raise PretrainedError(f"{path}: model folder does not exist")
    if not path.is_dir():
        raise PretrainedError(f"{path}: is not a folder (an exported model is a folder; a "
                              "checkpoint file loads with captioning.checkpoint.load_checkpoint)")
    for name in REQUIRED_FILES:
        if not (path / name).is_file():
            raise PretrainedError(
                f"{path / name}: missing; an exported model folder holds "
                f"{', '.join(REQUIRED_FILES)} (an interrupted export leaves no {CONFIG_FILE})")
    data = _config_data(path / CONFIG_FILE)
    model, decode, training = _config_parts(path / CONFIG_FILE, data)
    trained_on = data.get(TRAINED_ON, {})
    if not isinstance(trained_on, dict):
        raise PretrainedError(f"{path / CONFIG_FILE}: {TRAINED_ON!r} must be an object, got "
                              f"{type(trained_on).__name__}")
    try:
        vocab = Vocabulary.load(path / VOCAB_FILE)  # its errors name the file
    except UnicodeDecodeError:
        raise PretrainedError(f"{path / VOCAB_FILE}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise PretrainedError(f"{path / VOCAB_FILE}: cannot read ({e.strerror or e})") from None
    except ValueError as e:
        raise PretrainedError(_one_line(e)) from None
    weights = _read_weights(path / WEIGHTS_FILE)
    _check_digests(path, data.get("sha256"), model)  # after each file's checks: more telling
    return ModelFolder(path, model, decode, vocab, weights, training, trained_on)


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise PretrainedError(f"{file}: not valid JSON ({e.msg} at line {e.lineno} "
                              f"column {e.colno})") from None
    except UnicodeDecodeError:
        raise PretrainedError(f"{file}: not valid JSON (not UTF-8 text)") from None
    except OSError as e:
        raise PretrainedError(f"{file}: cannot read ({e.strerror or e})") from None


def read_config(file: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """config.json's model config, decoding settings and training settings ({} if absent)."""
    return _config_parts(file, _config_data(file))


def _config_data(file: Path) -> dict[str, Any]:
    """config.json, checked for its format and version."""
    data = _read_json(file)
    found = data.get("format") if isinstance(data, dict) else None
    if found != FORMAT:
        raise PretrainedError(f"{file}: not a captioning model folder config (format "
                              f"{found!r}, expected {FORMAT!r})")
    version = data.get("format_version")
    if not isinstance(version, int) or isinstance(version, bool) or version < 1:
        raise PretrainedError(f"{file}: invalid format_version {version!r}")
    if version > FORMAT_VERSION:
        raise PretrainedError(f"{file}: format_version {version} is newer than this version of "
                              f"captioning reads ({FORMAT_VERSION}); upgrade captioning")
    return data


def _config_parts(file: Path, data: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    model, decode, training = data.get("model"), data.get("decode", {}), data.get("training", {})
    for key, value in (("model", model), ("decode", decode), ("training", training)):
        if not isinstance(value, dict):
            raise PretrainedError(f"{file}: {key!r} must be an object, got "
                                  f"{type(value).__name__}")
    return model, decode, training


def sha256_of(file: Path) -> str:
    digest = hashlib.sha256()
    with open(file, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def settings_digest(settings: Mapping[str, Any]) -> str:
    """SHA-256 of a settings block as canonical JSON (sorted keys, no spaces)."""
    text = json.dumps(settings, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _check_digests(path: Path, digests: Any, model: Mapping[str, Any]) -> None:
    """The files' SHA-256, and the `model` settings', against those config.json records (none
    in older folders; no settings digest before it was recorded)."""
    if digests is None:
        return
    if not isinstance(digests, dict):
        raise PretrainedError(f"{path / CONFIG_FILE}: 'sha256' must be an object, got "
                              f"{type(digests).__name__}")
    want = digests.get(MODEL_DIGEST)
    if want is not None and want != settings_digest(model):
        raise PretrainedError(
            f"{path / CONFIG_FILE}: its 'model' settings are not the ones the weights were "
            "exported with (edited since; only 'decode' may change): export the model again")
    for name in (WEIGHTS_FILE, VOCAB_FILE):
        want = digests.get(name)
        try:
            got = sha256_of(path / name) if want is not None else None
        except OSError as e:
            raise PretrainedError(f"{path / name}: cannot read ({e.strerror or e})") from None
        if got != want:
            raise PretrainedError(
                f"{path / name}: its SHA-256 is not the one {CONFIG_FILE} records (changed or "
                "damaged since the model was exported): export the model again")


def _read_weights(file: Path) -> dict[str, Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except MemoryError:
        raise
    except OSError as e:
        raise PretrainedError(f"{file}: cannot read ({e.strerror or e})") from None
    except Exception as e:  # SafetensorError: truncated, corrupt or not safetensors at all
        raise PretrainedError(f"{file}: not a readable safetensors file "
                              f"({_one_line(e)})") from None


# -- writing ------------------------------------------------------------------------------------
def write_model_folder(path: str | os.PathLike[str], *, state: Mapping[str, Tensor],
                       model: Mapping[str, Any], decode: Mapping[str, Any], vocab: Vocabulary,
                       card: str, training: Mapping[str, Any] | None = None,
                       trained_on: Mapping[str, Any] | None = None) -> Path:
    """Write (or overwrite) the folder's four files; other files in it are left alone.
    `training` (the run's loss settings) and `trained_on` (its data source and carving rule)
    are kept in config.json when given.

    config.json goes first (removed) and last (written), so that an interrupted write never
    leaves a folder `is_pretrained_dir` takes for complete.
    """
    from safetensors.torch import save

    path = Path(path)
    if path.exists() and not path.is_dir():
        raise FileExistsError(f"{path}: exists and is not a folder")
    path.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(path)  # of a killed export: only our own temporaries are written
    (path / CONFIG_FILE).unlink(missing_ok=True)
    fsync_dir(path)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in state.items()}
    weights = save(tensors, metadata={"format": "pt"})  # bytes: no temporary of safetensors'
    write_atomic(path / WEIGHTS_FILE, lambda tmp: tmp.write_bytes(weights))
    write_atomic(path / VOCAB_FILE, vocab.save)
    write_atomic(path / CARD_FILE, lambda tmp: tmp.write_text(card, encoding="utf-8"))
    config = {"format": FORMAT, "format_version": FORMAT_VERSION,
              "model": dict(model), "decode": dict(decode),
              **({"training": dict(training)} if training else {}),
              **({TRAINED_ON: dict(trained_on)} if trained_on else {}),
              "sha256": {WEIGHTS_FILE: hashlib.sha256(weights).hexdigest(),
                         VOCAB_FILE: sha256_of(path / VOCAB_FILE),
                         MODEL_DIGEST: settings_digest(model)}}
    write_atomic(path / CONFIG_FILE, lambda tmp: tmp.write_text(
        json.dumps(config, indent=2) + "\n", encoding="utf-8"))
    fsync_dir(path)
    return path


# -- the model card -----------------------------------------------------------------------------
def model_card(model: Mapping[str, Any], decode: Mapping[str, Any], vocab_size: int, *,
               folder: str, title: str | None = None,
               sections: Sequence[tuple[str, str]] = ()) -> str:
    """README.md of a model folder: what the model is, `sections` (heading, markdown) such as
    its training data and results, its config and decoding settings, and how to load it."""
    grid = model.get("grid_size")
    parts = [
        f"# {title or 'Show, Attend and Tell image captioner'}",
        f"An image captioner after Xu et al. (2015), *Show, Attend and Tell*, with "
        f"**{model.get('attention', 'soft')} attention**: a `{model.get('backbone')}` CNN "
        f"encoder ({f'{grid}×{grid} grid' if grid else 'native grid'} of annotation vectors at "
        f"{model.get('image_size')} px) and an LSTM decoder (embedding "
        f"{model.get('embed_dim')}, hidden {model.get('hidden_dim')}, attention "
        f"{model.get('attn_dim')}) over a vocabulary of {vocab_size} words.",
        "Files: `model.safetensors` (weights), `config.json` (model config and decoding "
        "settings), `vocab.json` (vocabulary), this card. Loading reads JSON and safetensors "
        "only: no pickle, nothing in the folder can run code.",
        *(f"## {heading}\n\n{text.strip()}" for heading, text in sections),
        "## Model config\n\n" + json_block(model),
        "## Decoding\n\nThe settings captions are decoded with unless told otherwise:\n\n"
        + json_block(decode),
        _how_to_load(folder),
    ]
    return "\n\n".join(parts) + "\n"


def json_block(data: Any) -> str:
    """`data` as an indented JSON code block of a model card (values JSON lacks as strings)."""
    return "```json\n" + json.dumps(data, indent=2, default=str) + "\n```"


def _how_to_load(folder: str) -> str:
    return f"""## How to load

Caption images from the command line (`--beam-size`, `--json`, `--overlay` as with a checkpoint):

```bash
captioning caption --checkpoint {folder} img.jpg
```

In Python, `Captioner.from_pretrained` returns the model in eval mode, with its vocabulary
(`model.vocab`, a `captioning.vocab.Vocabulary`) and decoding settings (`model.decode`):

```python
import torch

from captioning.data.transforms import model_inputs
from captioning.models.captioner import Captioner

model = Captioner.from_pretrained({json.dumps(folder)})
images = model_inputs(["img.jpg"], model.config.image_size)  # files or PIL images, as the CLI
with torch.inference_mode():
    print(model.captions(images))  # text, decoded with model.decode
    gen = model.generate(images, model.decode)  # token ids, scores and attention maps
words = [model.vocab.decode(ids) for ids in gen.tokens.tolist()]
```

`vocab.json` is in `Vocabulary.save`'s format: `--data.vocab_path {folder}/vocab.json` trains
or evaluates with this model's words."""
