"""The configs shipped inside the package, and `captioning configs` to list them.

The YAML files live in `captioning/configs/` (package data; the repository's `configs/` is a
link to it, so there is one copy). `--config` takes a path, or a shipped config by name:
`paper_soft`, `model/paper_soft` or `model/paper_soft.yaml`.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Iterable, Sequence
from importlib.resources import files
from pathlib import Path
from typing import Any

from captioning.commands.errors import ConfigError
from captioning.run_folder import RUN_CHECKPOINTS

#: The shipped configs' folder: trainer/, data/, model/ (and later groups), each of YAML files.
CONFIG_DIR = Path(str(files("captioning") / "configs"))
#: Flags whose value is a config file (LightningCLI's `--config`, and one per group).
CONFIG_FLAGS = ("--config", "--trainer", "--data", "--model")


class UnknownConfigError(ConfigError):
    """A `--config` value that is neither a file nor a shipped config's name."""


def shipped_configs() -> dict[str, Path]:
    """Every shipped config by its name relative to CONFIG_DIR, without `.yaml`
    (e.g. "model/paper_soft"), sorted."""
    return {p.relative_to(CONFIG_DIR).with_suffix("").as_posix(): p
            for p in sorted(CONFIG_DIR.rglob("*.yaml"))}


def find_config(name: str, group: str | None = None) -> Path:
    """The file a `--config` value names: an existing path as given; else a shipped config by
    `group/name[.yaml]` or, when unambiguous, by `name` alone (in `group` when given)."""
    if Path(name).is_file():  # a folder (e.g. data/shapes, the generated dataset) is no config
        return Path(name)
    shipped = shipped_configs()
    key = name.removesuffix(".yaml").removeprefix("configs/")
    if key in shipped:
        return shipped[key]
    if group is not None and f"{group}/{key}" in shipped:
        return shipped[f"{group}/{key}"]
    matches = [k for k in shipped if k.rsplit("/", 1)[-1] == key
               and (group is None or k.startswith(f"{group}/"))]
    if len(matches) == 1:
        return shipped[matches[0]]
    if matches:
        raise UnknownConfigError(f"{name}: several shipped configs have this name "
                                 f"({', '.join(matches)}); give one of them")
    raise UnknownConfigError(f"{name}: no such file, and no shipped config of that name "
                             "(`captioning configs` lists them)")


def resolve_config_args(args: Sequence[str]) -> list[str]:
    """`args` with every config-file flag's value (`--config paper_soft`, `--model=demo_soft`)
    turned into the path of the file it names."""
    out = list(args)
    for i, arg in enumerate(out):
        flag, eq, value = arg.partition("=")
        if flag not in CONFIG_FLAGS:
            continue
        group = None if flag == "--config" else flag[2:]
        if eq:
            if value and _looks_like_file(value):
                out[i] = f"{flag}={check_yaml(find_config(value, group))}"
        elif i + 1 < len(out) and not out[i + 1].startswith("-") and _looks_like_file(out[i + 1]):
            out[i + 1] = str(check_yaml(find_config(out[i + 1], group)))
    return out


def check_yaml(path: Path) -> Path:
    """`path`, once its YAML parses; else a `ConfigError` naming the file, line and column
    (the parser behind `--config` would name only "<unicode string>")."""
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not a UTF-8 text file ({e.reason})") from None
    except yaml.MarkedYAMLError as e:
        where = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" \
            if e.problem_mark is not None else ""
        context = ""
        if e.context:
            start = e.context_mark
            context = f" ({e.context}" + (f" at line {start.line + 1}, column "
                                          f"{start.column + 1})" if start is not None else ")")
        raise ConfigError(f"{path}: invalid YAML{where}: {e.problem}{context}") from None
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {' '.join(str(e).split())}") from None
    except (ValueError, TypeError):
        return path  # a value safe_load cannot build (`2024-02-30`), which --config reads as text
    if data is None:
        raise ConfigError(f"{path}: no settings (an empty file, or comments only); a config is "
                          "a YAML mapping such as `trainer:` / `model:` / `data:` sections")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: a config is a YAML mapping of settings, got a "
                          f"{type(data).__name__}")
    return path


def trainer_config_in(path: Path, run_dir: Path, *, without: Iterable[str] = ()
                      ) -> dict[str, Any]:
    """The trainer config in `path` with every output folder in `run_dir` (the root, the
    loggers' save_dir, ModelCheckpoint's dirpath), less the loggers and callbacks named in
    `without` (by class name or class path): one run's config, for `demo` and `ablate`. A name
    in `without` that names none of them is an error."""
    import yaml

    cfg = yaml.safe_load(path.read_text())
    trainer = cfg["trainer"]
    trainer["default_root_dir"] = str(run_dir)
    for key in ("logger", "callbacks"):  # one mapping is a list of one (Lightning takes both)
        if hasattr(trainer.get(key), "get"):
            trainer[key] = [trainer[key]]
    paths = {key: [str(x.get("class_path", "")) if hasattr(x, "get") else ""
                   for x in trainer[key]]
             for key in ("logger", "callbacks") if isinstance(trainer.get(key), list)}
    dropped = {p for ps in paths.values() for p in ps for w in without
               if w in (p, p.rpartition(".")[2])}
    for key, ps in paths.items():
        trainer[key] = [x for x, p in zip(trainer[key], ps) if p not in dropped]
    missing = [w for w in without if not any(w in (p, p.rpartition(".")[2]) for p in dropped)]
    if missing:
        names = [p.rpartition(".")[2] for ps in paths.values() for p in ps if p]
        raise ConfigError(f"{path}: without {', '.join(missing)}: no logger or callback of this "
                          f"trainer config has that class name (it has: {', '.join(names)})")
    for entry, key in output_folders(trainer):
        entry.setdefault("init_args", {})[key] = str(run_dir / OUTPUT_FOLDERS[key])
    return cfg


#: The keys of a trainer config's output folders, and where each goes in a run folder.
OUTPUT_FOLDERS = {"save_dir": ".", "dirpath": RUN_CHECKPOINTS}


#: Where a `class_path` without a module (`ModelCheckpoint`) is found, as LightningCLI does.
SHORT_CLASS_MODULES = ("lightning.pytorch.callbacks", "lightning.pytorch.loggers",
                       "captioning.callbacks")


def entry_class(entry: Any) -> type | None:
    """The class a `class_path` config entry names (None when it does not import)."""
    path = entry.get("class_path") if hasattr(entry, "get") else None
    if not isinstance(path, str) or not path:
        return None
    module, _, name = path.rpartition(".")
    for where in [module] if module else SHORT_CLASS_MODULES:
        try:
            cls = getattr(importlib.import_module(where), name)
        except (ImportError, AttributeError):
            continue
        return cls if isinstance(cls, type) else None
    return None


def output_folders(trainer: Any) -> list[tuple[Any, str]]:
    """(entry, key) of each output folder a trainer config (YAML or parsed) names: its
    loggers' `save_dir` and the `dirpath` of its `ModelCheckpoint`s and their subclasses
    (`LatestCheckpoint` without one finds its own folder in `default_root_dir`)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    loggers = trainer.get("logger")
    found = [(lg, "save_dir") for lg in (loggers if isinstance(loggers, list) else [loggers])
             if hasattr(lg, "get") and lg.get("class_path")]
    return found + [(cb, "dirpath") for cb in trainer.get("callbacks") or []
                    if isinstance(cls := entry_class(cb), type) and issubclass(cls, ModelCheckpoint)]


def move_outputs(trainer: Any, old: str | Path, new: str | Path) -> list[str]:
    """Move the output folders of a parsed trainer config that lie in `old` (its run folder
    as the config file set it) to the same place in `new`; returns the moved keys' new paths."""
    moved = []
    for entry, key in output_folders(trainer):
        args = entry.get("init_args")
        value = args.get(key) if args is not None else None
        if value is None:
            continue
        rel = os.path.relpath(str(value), old)  # relative paths: to the current folder
        if rel == os.pardir or rel.startswith(os.pardir + os.sep):
            continue  # outside the old run folder: the user's own place
        args[key] = os.path.normpath(os.path.join(str(new), rel))
        moved.append(args[key])
    return moved


def _looks_like_file(value: str) -> bool:
    """A flag value that names a file rather than inline YAML (`--data '{batch_size: 4}'`)."""
    return ":" not in value and not value.lstrip().startswith(("{", "["))


def describe(path: Path) -> str:
    """A config's first comment line."""
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            return line.lstrip("# ").strip()
        if line.strip():
            break
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="captioning configs",
        description="List the configs shipped with the package; pass one to --config by name.")
    p.add_argument("--paths", action="store_true", help="print each config's file path")
    try:
        a = p.parse_args(argv)
    except SystemExit as e:
        return int(e.code) if isinstance(e.code, int) else 2
    shipped = shipped_configs()
    width = max(map(len, shipped), default=0)
    for name, path in shipped.items():
        sys.stdout.write(f"{name:<{width}}  {path if a.paths else describe(path)}\n")
    sys.stdout.write("\nUse: captioning fit --config trainer/cpu --config data/shapes "
                     "--config model/demo_soft\n")
    return 0
