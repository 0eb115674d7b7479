"""The `captioning` command.

* `captioning fit|validate|test --config configs/... [--data.root ...]`  (LightningCLI)
* `captioning demo [--attention soft|hard]`  generate shapes, train, test, print results
* `captioning shapes --root DIR`  write the synthetic shapes dataset
* `captioning caption --checkpoint CKPT IMAGE ...`  caption images with a checkpoint
* `captioning cache-features --config ...`  build the frozen-encoder feature cache ahead of time

Heavy imports (torch, lightning) happen inside the commands, so `--help` and `caption` start fast.

Failures a user can cause (bad arguments or config values, bad data, a missing or unsafe
checkpoint, a non-finite loss) end with one `error: ...` line on stderr and exit status 2
(arguments, config) or 1 (everything else), not a traceback; anything else is a bug and keeps
its traceback. An interrupted `fit` (Ctrl-C, SIGTERM) exits with 130 / 143 after saying where
its checkpoint went (see `captioning.callbacks.CheckpointOnInterrupt`).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("captioning")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
#: `ckpt_path` values Lightning resolves itself (not file paths).
SPECIAL_CKPT_PATHS = frozenset({"last", "best", "hpc", "registry"})


class ConfigError(ValueError):
    """A bad value on the command line or in a config file."""


def user_error_types() -> tuple[type[BaseException], ...]:
    """Exceptions that report a user's mistake, not a bug: shown as one line, no traceback."""
    from captioning.data.images import ImageLoadError
    from captioning.data.readers import DataError

    types: list[type[BaseException]] = [ConfigError, DataError, ImageLoadError,
                                        FloatingPointError, FileNotFoundError]
    try:
        from captioning.checkpoint import CheckpointError
    except ImportError:  # pragma: no cover
        pass
    else:
        types.append(CheckpointError)
    return tuple(types)


def _type_name(text: str) -> str:
    text = text.strip()
    found = re.fullmatch(r"<class '(?:[\w.]+\.)?(\w+)'>", text)
    if found:
        return "null" if found.group(1) == "NoneType" else found.group(1)
    found = re.fullmatch(r"(?:typing\.)?Literal\[(.*)\]", text)
    if found:
        return f"one of {found.group(1)}"
    return text


def parser_error_line(message: str) -> str:
    """jsonargparse's multi-line error, in one line: `--key: invalid value 'x' (expected ...)`."""
    lines = [ln.strip() for ln in str(message).splitlines() if ln.strip()]
    if not lines:
        return "invalid arguments"
    head = re.match(r'^Parser key "([^"]+)":\s*(.*)$', lines[0])
    if head is None:
        return " ".join(lines)
    key, rest = head.groups()
    body = [rest, *lines[1:]] if rest else lines[1:]
    value = expected = None
    types: list[str] = []
    for ln in body:
        found = re.search(r"(?:Given|Got) value:\s*(.*)$", ln)
        if found:
            value = found.group(1)
        found = re.match(r"^(?:- )?Expected an? (.+?)(?:\. Got value:.*)?$", ln)
        if found:
            types.append(_type_name(found.group(1)))
    if types:
        expected = " or ".join(dict.fromkeys(types))
    if value is not None:
        return f"--{key}: invalid value {value!r}" + (f" (expected {expected})" if expected else "")
    return f"--{key}: " + " ".join(body)


def check_checkpoint_file(ckpt_path: str | os.PathLike[str] | None) -> None:
    """Refuse a missing checkpoint, or one whose pickle would run code, before Lightning opens it.

    The file is read with `torch.load(weights_only=True, mmap=True)`: only the pickle is
    parsed (the tensors stay on disk), and an unsafe one is refused before anything in it runs.
    Lightning's special values ("last", "best", ...) and URLs are left to Lightning.
    """
    if ckpt_path is None or str(ckpt_path) in SPECIAL_CKPT_PATHS or "://" in str(ckpt_path) \
            or str(ckpt_path).startswith("registry:"):
        return
    from captioning.checkpoint import _read

    _read(Path(ckpt_path), "cpu", mmap=True)


def wandb_dirs(run_dir: str | Path) -> dict[str, str]:
    """W&B's own folders, all inside the run folder (offline runs leave nothing elsewhere)."""
    base = Path(run_dir).resolve()
    return {
        "WANDB_DIR": str(base),
        "WANDB_DATA_DIR": str(base / "wandb-data"),
        "WANDB_CACHE_DIR": str(base / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(base / "wandb-config"),
    }


# Model settings that only affect decoding and outputs: a checkpoint's stored values give way to
# the user's (see CaptioningCLI._parse_ckpt_path).
EVAL_TIME_KEYS = tuple(f"model.{k}" for k in (
    "eval_strategy", "beam_size", "max_len", "length_penalty", "forbid_unk", "compute_metrics",
    "results_dir", "compile", "net.hard_decode"))


def _given(args: Sequence[str], key: str) -> bool:
    """Whether `key` (e.g. "model.beam_size") is set by a flag or a config file in `args`."""
    group, _, rest = key.partition(".")
    for i, a in enumerate(args):
        if a == f"--{key}" or a.startswith(f"--{key}="):
            return True
        files = {"--config": key, f"--{group}": rest}
        if a in files and i + 1 < len(args) and _yaml_has(args[i + 1], files[a]):
            return True
    return False


def _yaml_has(path: str, key: str) -> bool:
    import yaml

    try:
        node: Any = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError):
        return False
    for part in key.split("."):
        if isinstance(node, dict) and part not in node and isinstance(node.get("init_args"), dict):
            node = node["init_args"]  # class_path / init_args form
        if not isinstance(node, dict) or node.get(part) is None:
            return False
        node = node[part]
    return True


def _lightning_cli(args: Sequence[str] | None, *, run: bool = True) -> Any:
    from lightning.pytorch.cli import LightningCLI

    from captioning.data.datamodule import CaptionDataModule
    from captioning.lit_module import CaptioningModule

    class CaptioningCLI(LightningCLI):
        def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                         subparser_kwargs: dict[str, Any]) -> None:
            super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
            # Checkpoints are loaded with torch.load(weights_only=True) unless asked otherwise.
            parsers = getattr(self, "_subcommand_parsers", {}) if add_subcommands else {}
            for parser in parsers.values():
                if "weights_only" in parser.get_defaults():
                    parser.set_defaults(weights_only=True)
            if not add_subcommands and "weights_only" in self.parser.get_defaults():
                self.parser.set_defaults(weights_only=True)

        def parse_arguments(self, parser: Any, args: Any) -> None:
            self._raw_args = args
            super().parse_arguments(parser, args)
            sub = self.config.get("subcommand")
            if sub:  # before Lightning reads the checkpoint's hyperparameters
                check_checkpoint_file(self.config[sub].get("ckpt_path"))

        def _parse_ckpt_path(self) -> None:
            # Lightning replaces the model's whole config by the checkpoint's hyperparameters.
            # Decoding and output settings the user set (in a config file or on the command
            # line, i.e. away from their defaults) must still win: `--model.beam_size 5` at
            # test time has to decode with beam 5.
            sub = self.config.get("subcommand")
            if not sub or not self.config[sub].get("ckpt_path"):
                return super()._parse_ckpt_path()
            raw = list(sys.argv[1:] if self._raw_args is None else self._raw_args)
            user = {k: self.config[sub].get(k) for k in EVAL_TIME_KEYS if _given(raw, k)}
            super()._parse_ckpt_path()
            for k, v in user.items():
                self.config[sub][k] = v

        def instantiate_classes(self) -> None:
            from lightning.fabric.utilities.exceptions import MisconfigurationException

            try:
                super().instantiate_classes()
            except user_error_types():
                raise
            except (ValueError, MisconfigurationException, ModuleNotFoundError) as e:
                # a constructor refused a value, or an option needs a package not installed
                log.debug("instantiating the classes failed", exc_info=True)
                raise ConfigError(str(e)) from e

        def add_arguments_to_parser(self, parser: Any) -> None:
            # The data module owns the vocabulary; the model is sized from it.
            parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
            parser.link_arguments("data.image_size", "model.net.image_size")

        def before_instantiate_classes(self) -> None:
            cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
            logger = cfg.get("trainer", {}).get("logger")
            loggers = logger if isinstance(logger, list) else [logger]
            for lg in loggers:
                if hasattr(lg, "get") and "Wandb" in str(lg.get("class_path", "")):
                    save_dir = lg.get("init_args", {}).get("save_dir") or "."
                    Path(save_dir).mkdir(parents=True, exist_ok=True)
                    for k, v in wandb_dirs(save_dir).items():
                        os.environ.setdefault(k, v)
                        Path(v).mkdir(parents=True, exist_ok=True)

    # Parse errors raise ArgumentError (reported in one line by `main`) instead of printing
    # the whole usage and exiting.
    no_exit = {"exit_on_error": False}
    return CaptioningCLI(
        CaptioningModule,
        CaptionDataModule,
        save_config_kwargs={"overwrite": True},
        parser_kwargs={**no_exit, **{c: dict(no_exit) for c in LIGHTNING_COMMANDS}},
        args=list(args) if args is not None else None,
        run=run,
    )


def _shapes(argv: Sequence[str]) -> int:
    from captioning.data.shapes import generate_shapes

    p = argparse.ArgumentParser(prog="captioning shapes", description="Write the shapes dataset.")
    p.add_argument("--root", default="data/shapes")
    p.add_argument("--num-train", type=int, default=6000)
    p.add_argument("--num-val", type=int, default=250)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    root = generate_shapes(a.root, num_train=a.num_train, num_val=a.num_val,
                           num_test=a.num_test, image_size=a.image_size, seed=a.seed)
    log.info("shapes dataset ready at %s", root)
    return 0


def _error(message: str) -> None:
    sys.stderr.write(f"error: {message}\n")


def _interrupted(exc: BaseException) -> int:
    """Report an interrupted command; returns the exit status (130 Ctrl-C, 143 SIGTERM)."""
    cause = getattr(exc, "interrupt", None) or (
        "KeyboardInterrupt" if isinstance(exc, KeyboardInterrupt) else "SIGTERM")
    path = getattr(exc, "checkpoint_path", None)
    what = "SIGTERM" if cause == "SIGTERM" else "Ctrl-C"
    if path:
        msg = f"interrupted by {what}; saved {path} (resume with --ckpt_path last)"
    else:
        msg = f"interrupted by {what}"
    sys.stderr.write(msg + "\n")
    return 143 if cause == "SIGTERM" else 130


def _exit_status(exc: BaseException) -> int | None:
    """Report `exc` if it is a user error or an interruption; None for everything else."""
    if isinstance(exc, argparse.ArgumentError):
        _error(parser_error_line(str(exc)))
        return 2
    exceptions = sys.modules.get("lightning.pytorch.utilities.exceptions")
    sigterm = getattr(exceptions, "SIGTERMException", None)
    if sigterm is not None and isinstance(exc, sigterm):
        return _interrupted(exc)
    if isinstance(exc, SystemExit):
        # Lightning turns a KeyboardInterrupt during fit into sys.exit(1)
        if exc.code == 1 and isinstance(exc.__context__, KeyboardInterrupt):
            return _interrupted(exc.__context__)
        return None
    if isinstance(exc, KeyboardInterrupt):
        return _interrupted(exc)
    if isinstance(exc, user_error_types()):
        log.debug("user error", exc_info=exc)
        _error(str(exc).strip() or type(exc).__name__)
        return 2 if isinstance(exc, ConfigError) else 1
    return None


def _finish_wandb(failed: bool) -> None:
    """End the W&B run a command started, so that the next command in this process (tests,
    notebooks) starts its own instead of reusing it."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


def _run(argv: list[str], from_shell: bool) -> int:
    command = argv[0] if argv else ""
    if command in ("caption", "shapes"):  # no W&B
        return _dispatch(command, argv, from_shell)
    try:
        status = _dispatch(command, argv, from_shell)
    except BaseException:
        _finish_wandb(failed=True)
        raise
    _finish_wandb(failed=False)
    return status


def _dispatch(command: str, argv: list[str], from_shell: bool) -> int:
    if command == "caption":
        from captioning.caption import main as caption_main

        return caption_main(argv[1:])
    if command == "demo":
        from captioning.demo import main as demo_main

        return demo_main(argv[1:])
    if command == "shapes":
        return _shapes(argv[1:])
    if command == "cache-features":
        from captioning.data.features import main as cache_main

        return cache_main(argv[1:])
    _lightning_cli(None if from_shell else argv)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run a `captioning` command; returns its exit status."""
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    try:
        return _run(argv, from_shell)
    except BaseException as e:
        status = _exit_status(e)
        if status is None:
            raise
        return status


if __name__ == "__main__":
    sys.exit(main())
