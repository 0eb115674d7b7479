"""An ablation grid file (`configs/ablations/*.yaml`): found by name or path, read and checked
(`load_grid`), for `captioning ablate`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from captioning.commands.configs import CONFIG_DIR, find_config
from captioning.commands.errors import ConfigError

GRID_DIR = CONFIG_DIR / "ablations"
DEFAULT_METRICS = ("BLEU-4", "CIDEr", "objects_correct", "pointing_accuracy", "train_seconds",
                   "alpha_entropy")


@dataclass(frozen=True)
class Grid:
    """A parsed grid file."""

    name: str
    configs: tuple[str, ...]
    overrides: dict[str, Any]
    without: tuple[str, ...]
    seeds: tuple[int, ...]
    metrics: tuple[str, ...]
    variants: dict[str, dict[str, Any]]


def find_grid(name: str) -> Path:
    """A grid file: a path as given, else `configs/ablations/<name>.yaml`."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = GRID_DIR / f"{name.removesuffix('.yaml')}.yaml"
    if shipped.is_file():
        return shipped
    known = ", ".join(sorted(p.stem for p in GRID_DIR.glob("*.yaml")))
    raise ConfigError(f"--grid {name}: no such file and no shipped grid (shipped: {known})")


def load_grid(path: Path) -> Grid:
    """Read and check a grid file."""
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f" (line {mark.line + 1})" if mark is not None else ""
        raise ConfigError(f"{path}: not valid YAML{at}: {getattr(e, 'problem', None) or e}"
                          ) from None
    if not isinstance(data, dict) or not isinstance(data.get("base") or {}, dict):
        raise ConfigError(f"{path}: a grid is a mapping with `variants` and an optional `base` "
                          "mapping (configs, overrides, without)")
    base, variants = data.get("base") or {}, data.get("variants") or {}
    if not isinstance(variants, dict) or not variants:
        raise ConfigError(f"{path}: `variants` must map each variant's name to its overrides")
    for name, over in variants.items():
        if not isinstance(over, dict | type(None)):
            raise ConfigError(f"{path}: variant {name!r} must be a mapping of overrides")
    seeds = data.get("seeds", [0])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise ConfigError(f"{path}: `seeds` must be a list of integers")
    return Grid(name=path.stem, configs=tuple(base.get("configs") or ()),
                overrides=dict(base.get("overrides") or {}),
                without=tuple(base.get("without") or ()), seeds=tuple(seeds),
                metrics=tuple(data.get("metrics") or DEFAULT_METRICS),
                variants={str(k): dict(v or {}) for k, v in variants.items()})


def config_file(name: str) -> Path:
    """A grid's config: a YAML file by path, else a shipped config by name (`data/shapes` is a
    config here even where a `data/shapes/` dataset folder exists)."""
    path = Path(name)
    if path.is_file():
        return path
    shipped = CONFIG_DIR / f"{name.removesuffix('.yaml')}.yaml"
    return shipped if shipped.is_file() else find_config(name)
