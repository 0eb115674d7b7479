"""What to do next, in the one-line errors of `captioning fit|validate|test`: the config file
that holds an unknown key and the closest valid key, what to pass when a command has no
weights to evaluate, the way round a missing GPU, and the `max_epochs` a resumed run needs.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from captioning.commands.errors import parser_error_line

#: Commands that evaluate a trained model: without weights they would score random ones.
EVALUATING = ("validate", "test", "predict")
#: Lightning's words when the trainer config asks for a GPU that this machine does not have.
NO_GPU_WORDS = ("No supported gpu backend found",
                "can not run on your system since the accelerator is not available")
NO_GPU_HINT = ("no GPU is usable on this machine: use --config trainer/cpu or "
               "--trainer.accelerator cpu")
#: Lightning's refusal to resume a checkpoint past `max_epochs` (checkpoint_connector.py).
RESTORED_PAST_MAX = re.compile(r"You restored a checkpoint with current_epoch=(\d+), but you "
                               r"have set Trainer\(max_epochs=(-?\d+)\)")
#: jsonargparse's refusal of an unknown setting of a `class_path` (a data source, a logger).
_INVALID_VALUE = re.compile(r'^\s*Parser key "([^"]+)"')
_NOT_ACCEPTED = re.compile(r"Parser key \"([\w.]+)\":.*?class_path '([\w.]+)':\s*"
                           r"Option '([\w.]+)' is not accepted", re.S)
_UNKNOWN = (re.compile(r"^Subcommand '[\w-]+' does not accept option '([\w.-]+)'"),
            re.compile(r"^unrecognized arguments: --([\w.-]+)"))


def no_weights_message(command: str) -> str:
    """The refusal of `validate|test|predict` without `--ckpt_path` (nor `model.init_from`)."""
    return (f"{command} needs trained weights: pass --ckpt_path with a checkpoint file, `last`, "
            "`best`, a run folder or an exported model folder (or set model.init_from); "
            "without one the model's random initial weights would be scored")


def no_gpu_message(message: str) -> str | None:
    """Lightning's no-GPU refusal with the way round it; None for other messages."""
    if not any(words in message for words in NO_GPU_WORDS):
        return None
    return f"{message.strip()} ({NO_GPU_HINT})"


def max_epochs_message(ckpt_path: Any, epoch: int, max_epochs: int,
                       trained: int | None = None) -> str:
    """The refusal to resume a checkpoint at `epoch` (Lightning's `current_epoch` once it is
    restored; `trained`: the epochs it has trained, when known) with a smaller `max_epochs`."""
    more, done = "a larger --trainer.max_epochs", ""
    if trained is not None:
        more, done = f"--trainer.max_epochs {trained + 1} or more", f" ({trained} epochs trained)"
    return (f"--ckpt_path {ckpt_path}: the checkpoint is at epoch {epoch}{done}, but "
            f"trainer.max_epochs is {max_epochs}; to train on from it pass {more}, or start a "
            "new run without --ckpt_path")


def restored_past_max(message: str, ckpt_path: Any) -> str | None:
    """`max_epochs_message` for Lightning's own refusal; None for other messages."""
    found = RESTORED_PAST_MAX.search(message)
    if found is None:
        return None
    return max_epochs_message(ckpt_path, int(found.group(1)), int(found.group(2)))


def checkpoint_epochs(checkpoint: Mapping[str, Any]) -> tuple[int, int] | None:
    """(the `current_epoch` a trainer resumed from a Lightning checkpoint starts at, the epochs
    it has trained); None when the checkpoint does not say."""
    node: Any = checkpoint
    for key in ("loops", "fit_loop", "epoch_progress", "current"):
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    epoch, trained = node.get("completed"), node.get("processed")
    if not all(isinstance(n, int) and not isinstance(n, bool) for n in (epoch, trained)):
        return None
    return epoch, trained


def yaml_lookup(path: str | Path, key: str) -> tuple[bool, Any]:
    """(whether the YAML file at `path` has the dotted `key`, its value); class_path/init_args
    aware. A missing or unreadable file has no key."""
    import yaml

    try:
        node: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return False, None
    for part in key.split("."):
        if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def config_file_with(args: Sequence[str], key: str) -> str | None:
    """The last config file in `args` (`--config FILE`, `--model FILE`, `--data=FILE`, ...)
    that sets the dotted `key`, as given; None when no config file does."""
    group, _, rest = key.partition(".")
    found = None
    for i, a in enumerate(args):
        flag, eq, value = a.partition("=")
        if not eq:
            value = args[i + 1] if i + 1 < len(args) else ""
        wanted = {"--config": key, f"--{group}": rest}.get(flag)
        if wanted and value and yaml_lookup(value, wanted)[0]:
            found = value
    return found


def unknown_option_message(message: str, args: Sequence[str], keys: Iterable[str]) -> str | None:
    """jsonargparse's refusal of an unknown key, with the config file that holds it (when one
    does) and the closest valid key among `keys`; None for other messages."""
    text = message.strip()
    matches = [(pattern.search(text), dashes) for pattern, dashes in zip(_UNKNOWN, ("", "--"))]
    found, dashes = next(((m, d) for m, d in matches if m), (None, ""))
    if found is None:
        return None
    key = found.group(1)
    where = config_file_with(args, key) if not dashes else None
    text = text.splitlines()[0]
    if where is not None:
        text = f"{where}: {text}"
    close = difflib.get_close_matches(key, list(keys), n=1)
    return f"{text}; did you mean {dashes}{close[0]}?" if close else text


def invalid_value_message(message: str, args: Sequence[str]) -> str | None:
    """jsonargparse's refusal of a value that a config file gave (no flag did), in one line
    naming that file: `FILE: model.net.embed_dim: invalid value ...`; None otherwise."""
    found = _INVALID_VALUE.match(message)
    if found is None:
        return None
    key = found.group(1)
    if any(a == f"--{key}" or a.startswith(f"--{key}=") for a in args):
        return None
    where = config_file_with(args, key)
    return f"{where}: {parser_error_line(message).removeprefix('--')}" if where else None


def not_accepted_message(message: str, args: Sequence[str]) -> str | None:
    """jsonargparse's many-line refusal of an unknown `init_args` key of a `class_path`, as one
    line: the config file that holds it (when one does), the class's settings and the
    closest one; None for other messages."""
    found = _NOT_ACCEPTED.search(message)
    if found is None:
        return None
    key, class_path, option = found.groups()
    module, _, name = class_path.rpartition(".")
    try:
        params = [p for p in inspect.signature(getattr(importlib.import_module(module), name))
                  .parameters if p not in ("args", "kwargs")]
    except (ImportError, AttributeError, TypeError, ValueError):
        params = []
    text = f"{key}: {name} does not accept {option!r}"
    if params:
        text += f" (its settings: {', '.join(params)})"
    close = difflib.get_close_matches(option, params, n=1)
    if close:
        text += f"; did you mean {key}.init_args.{close[0]}?"
    where = config_file_with(args, f"{key}.{option}")
    return f"{where}: {text}" if where else text
