"""`captioning fit|validate|test|predict --config ...`: LightningCLI with the project's rules.

* `--ckpt_path last|best|FOLDER` is resolved to one file (`commands.checkpoints`), and every
  checkpoint is checked (missing, truncated, unsafe pickle, not a Lightning checkpoint) before
  Lightning opens it, and read with `torch.load(weights_only=True)`;
* with `--ckpt_path`, the checkpoint's model hyperparameters replace the config, except for the
  decoding and output settings the user gave (`USER_WINS`): `--model.decode.beam_size 5` at
  test time decodes with beam 5; any other `--model.*` flag that disagrees with the checkpoint
  (e.g. `--model.net.hidden_dim`) is an error naming both values;
* `model.init_from: CKPT` starts a run from a trained model's weights (SCST after cross-entropy):
  see `CaptioningCLI._apply_init_from`;
* `validate`, `test` (and `predict`) refuse to run without weights: no `--ckpt_path` and no
  `model.init_from` would score the random initial weights (`hints.no_weights_message`);
* `fit --ckpt_path` of a checkpoint past `trainer.max_epochs` is one line naming both numbers;
* a constructor that refuses a value becomes a `ConfigError` (one line, exit status 2); a GPU
  trainer config on a machine without one says to use `trainer/cpu`;
* an unknown key names the config file that holds it and the closest valid key;
* W&B's folders go inside the logger's `save_dir`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import sys
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

from lightning.pytorch.cli import LightningCLI

from captioning.atomic import write_json_atomic
from captioning.callbacks.problems import DataProblemsFile
from captioning.checkpoint import (
    CHECKPOINT_VOCAB_KEY,
    CheckpointError,
    LoadedModel,
    load_checkpoint,
    read_checkpoint,
    upgrade_hparams,
)
from captioning.commands.checkpoints import (
    explicit_conflicts,
    folders_outside,
    resolve_ckpt_path,
    set_aside_earlier_checkpoints,
)
from captioning.commands.configs import move_outputs, resolve_config_args
from captioning.commands.errors import ConfigError, user_error_types
from captioning.commands.hints import (
    EVALUATING,
    checkpoint_epochs,
    config_file_with,
    invalid_value_message,
    max_epochs_message,
    no_gpu_message,
    no_weights_message,
    not_accepted_message,
    restored_past_max,
    unknown_option_message,
    yaml_lookup,
)
from captioning.data.carving import CARVING_KEY, carving_record, check_carving
from captioning.data.datamodule import CaptionDataModule
from captioning.data.problems import DataError, save_problems
from captioning.launch import launcher_rank_zero
from captioning.lit_module import CaptioningModule
from captioning.locks import claim_folder
from captioning.models.captioner import DecodeConfig
from captioning.models.pretrained import (
    CONFIG_FILE,
    VOCAB_FILE,
    PretrainedError,
    is_pretrained_dir,
    read_config,
    read_model_folder,
)
from captioning.vocab import Vocabulary

log = logging.getLogger(__name__)

LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")
#: Model settings that only affect decoding and outputs: a checkpoint's stored values give way
#: to the ones the user set in a config file or on the command line.
USER_WINS = (*(f"model.decode.{f.name}" for f in fields(DecodeConfig)), "model.compute_metrics",
             "model.spice", "model.results_dir", "model.fast_path", "model.fast_bucket",
             "model.fast_beam", "model.net.hard_decode")
#: Settings that only decide how a model is initialised: with a checkpoint every weight comes
#: from it, so a flag that differs from the checkpoint's is no conflict.
INIT_ONLY = ("model.net.weights", "model.net.weight_init", "model.init_from")
#: Model settings that `model.init_from` never takes from its checkpoint: the new stage's own.
INIT_FROM_KEEPS = ("_instantiator", "vocab_size", "init_from", "objective", "scst")
#: Where `model.init_from` puts its checkpoint's vocabulary for the data module, in the run folder.
INIT_FROM_VOCAB = "init_from_vocab.json"
#: Where `validate` / `test` put the checkpoint's vocabulary when the data's is another.
CHECKPOINT_VOCAB = "checkpoint_vocab.json"


def wandb_dirs(run_dir: str | Path) -> dict[str, str]:
    """W&B's own folders, all inside the run folder (offline runs leave nothing elsewhere)."""
    base = Path(run_dir).resolve()
    return {
        "WANDB_DIR": str(base),
        "WANDB_DATA_DIR": str(base / "wandb-data"),
        "WANDB_CACHE_DIR": str(base / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(base / "wandb-config"),
    }


def given(args: Sequence[str], key: str) -> bool:
    """Whether `key` (e.g. "model.decode.beam_size") is set by a flag or a config file in
    `args` (`--key v`, `--key=v`, `--config FILE`, `--model FILE`)."""
    group, _, rest = key.partition(".")
    for i, a in enumerate(args):
        if a == f"--{key}" or a.startswith(f"--{key}="):
            return True
        files = {"--config": key, f"--{group}": rest}
        if a in files and i + 1 < len(args) and yaml_has(args[i + 1], files[a]):
            return True
    return False


def yaml_has(path: str, key: str) -> bool:
    """Whether the YAML file at `path` sets the dotted `key` (class_path/init_args aware)."""
    found, value = yaml_lookup(path, key)
    return found and value is not None


class CaptioningCLI(LightningCLI):
    """LightningCLI for `CaptioningModule` and `CaptionDataModule` (see the module docstring)."""

    def setup_parser(self, add_subcommands: bool, main_kwargs: dict[str, Any],
                     subparser_kwargs: dict[str, Any]) -> None:
        super().setup_parser(add_subcommands, main_kwargs, subparser_kwargs)
        # Checkpoints are loaded with torch.load(weights_only=True) unless asked otherwise.
        parsers = getattr(self, "_subcommand_parsers", {}) if add_subcommands else {}
        for parser in [*parsers.values(), *([] if add_subcommands else [self.parser])]:
            if "weights_only" in parser.get_defaults():
                parser.set_defaults(weights_only=True)

    def parse_arguments(self, parser: Any, args: Any) -> None:
        # `lightning_cli` always passes the arguments (config names resolved to files), so
        # LightningCLI's warning about `args` given beside `sys.argv` would be about our wiring.
        self._raw_args = args
        try:
            self.config = parser.parse_args(args)
        except argparse.ArgumentError as e:
            better = unknown_option_message(str(e), list(args or []), self._known_keys(args)) \
                or not_accepted_message(str(e), list(args or [])) \
                or invalid_value_message(str(e), list(args or []))
            if better is None:
                raise
            raise argparse.ArgumentError(None, better) from None

    def _known_keys(self, args: Sequence[str] | None) -> list[str]:
        """The keys the parser of the command in `args` accepts (dotted, e.g. "trainer.devices")."""
        parsers = getattr(self, "_subcommand_parsers", None) or {}
        command = next((a for a in args or [] if a in parsers), None)
        parser = parsers[command] if command is not None else self.parser
        return list(parser.get_defaults().keys())

    def _parse_ckpt_path(self) -> None:
        """Check the checkpoint (one read: missing, unsafe or corrupt files end in one line);
        its model hyperparameters (in today's layout) replace the config's, except the
        `USER_WINS` settings the user gave. An exported model folder (`captioning export`)
        gives its config, decoding settings and vocabulary the same way; its weights are
        loaded after the model is built (`validate` and `test` only: it has no training state)."""
        sub = self.config.get("subcommand")
        if sub:
            self._move_run(sub)
        ckpt_path = self.config[sub].get("ckpt_path") if sub else None
        if ckpt_path and is_pretrained_dir(ckpt_path):
            self._apply_hparams(sub, self._use_model_folder(sub, Path(ckpt_path)), ckpt_path)
            return
        if not sub:
            return
        if sub in EVALUATING and not ckpt_path and not self.config[sub].get("model.init_from"):
            raise ConfigError(no_weights_message(sub))  # else: random weights, scored
        # `last`, `best` and folders become one file, checked like any other (checkpoints.py)
        ckpt_path, data = resolve_ckpt_path(ckpt_path, self.config[sub]["trainer"], sub)
        self.config[sub]["ckpt_path"] = ckpt_path
        if data is None:
            return
        max_epochs, epochs = self.config[sub]["trainer"].get("max_epochs"), checkpoint_epochs(data)
        if sub == "fit" and epochs is not None and max_epochs not in (None, -1) \
                and epochs[0] > max_epochs:  # Lightning's own check, before the data setup
            raise ConfigError(max_epochs_message(ckpt_path, epochs[0], max_epochs, epochs[1]))
        if sub in EVALUATING and isinstance(data.get(CHECKPOINT_VOCAB_KEY), dict):
            self._checkpoint_vocab = data[CHECKPOINT_VOCAB_KEY]  # the data module's, below
        hparams = upgrade_hparams(data.get("hyper_parameters") or {})
        hparams.pop("_instantiator", None)
        if hparams:
            self._apply_hparams(sub, hparams, ckpt_path)

    def _move_run(self, sub: str) -> None:
        """`--trainer.default_root_dir DIR` on the command line moves the whole run, as `demo`
        and `ablate` place theirs: the loggers' `save_dir` and the checkpoint folders that lay
        in the config file's own run folder go to the same place in DIR."""
        raw, key = list(self._raw_args or []), "trainer.default_root_dir"
        where = config_file_with(raw, key)
        if where is None or not any(a == f"--{key}" or a.startswith(f"--{key}=") for a in raw):
            return
        found, old = yaml_lookup(where, key)  # a --config file, else a --trainer one
        old = old if found else yaml_lookup(where, key.partition(".")[2])[1]
        new = self.config[sub]["trainer"]["default_root_dir"]
        if old is not None and new is not None and str(old) != str(new):
            for path in move_outputs(self.config[sub]["trainer"], str(old), str(new)):
                log.info("run folder %s: %s (was in %s)", new, path, old)

    def _apply_hparams(self, sub: str, hparams: dict[str, Any], source: str,
                       flag: str = "--ckpt_path") -> None:
        """The checkpoint's model settings replace the config's; a `--model.*` flag that
        disagrees with them is an error, except the `USER_WINS` settings, which win. `flag`:
        the setting that named the checkpoint, for the message."""
        raw = list(sys.argv[1:] if self._raw_args is None else self._raw_args)
        conflicts = explicit_conflicts(raw, self.config[sub], hparams,
                                       (*USER_WINS, *INIT_ONLY))
        if conflicts:
            raise ConfigError(f"{'; '.join(conflicts)}: with a checkpoint the model settings "
                              f"are those of {source}, except decoding and output; drop the "
                              f"flag, or start a new run without {flag}")
        user = {k: self.config[sub].get(k) for k in USER_WINS if given(raw, k)}
        self.config = self.parser.parse_object({sub: {"model": hparams}}, self.config)
        for k, v in user.items():
            self.config[sub][k] = v

    def _use_model_folder(self, sub: str, folder: Path) -> dict[str, Any]:
        """Read an exported model folder for `--ckpt_path DIR`: its model settings (the network,
        decoding and, where config.json has them, the loss settings) are returned, its
        vocabulary becomes the data module's (unless `--data.vocab_path` is given) and the run
        starts from no checkpoint."""
        if sub == "fit":
            raise ConfigError(f"--ckpt_path {folder}: an exported model folder has no training "
                              "state to resume; use it with validate, test, caption or predict")
        try:
            self._model_folder = read_model_folder(folder)
        except PretrainedError as e:
            raise CheckpointError(str(e)) from None
        if sub in ("validate", "test"):  # scores on carved splits: its run's rule, checked
            self._init_carving = carving_record(self._model_folder.trained_on, str(folder))
        raw = list(sys.argv[1:] if self._raw_args is None else self._raw_args)
        if not given(raw, "data.vocab_path"):
            self.config[sub]["data"]["vocab_path"] = str(folder / VOCAB_FILE)
        self.config[sub]["ckpt_path"] = None
        # an older folder's settings hold the fields it predates, as a checkpoint's do
        return upgrade_hparams({"net": {**self._model_folder.model, "weights": None},
                                "decode": self._model_folder.decode,
                                **self._model_folder.training})

    def instantiate_classes(self) -> None:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        try:
            super().instantiate_classes()
            if self._run_root is not None:  # the data's problems, once a stage's data is set up
                self.trainer.callbacks.append(DataProblemsFile(self._run_root))
            folder = getattr(self, "_model_folder", None)
            if folder is not None:
                folder.load_into(self.model.captioner)
        except user_error_types():
            raise
        except PretrainedError as e:
            raise CheckpointError(str(e)) from None
        except (ValueError, MisconfigurationException, ModuleNotFoundError) as e:
            # a constructor refused a value, or an option needs a package not installed
            raise ConfigError(no_gpu_message(str(e)) or str(e)) from e

    def _run_subcommand(self, subcommand: str) -> None:
        from lightning.fabric.utilities.exceptions import MisconfigurationException

        cfg = self.config[subcommand]
        if subcommand == "fit" and not cfg.get("ckpt_path") and launcher_rank_zero():
            # once every setting is accepted: a refused command moves nothing
            set_aside_earlier_checkpoints(cfg.get("trainer", {}), cfg.get("model.init_from"))
        try:
            super()._run_subcommand(subcommand)
        except MisconfigurationException as e:
            ckpt_path = self.config[subcommand].get("ckpt_path")
            message = restored_past_max(str(e), ckpt_path)
            if message is None:
                raise
            raise ConfigError(message) from e

    def add_arguments_to_parser(self, parser: Any) -> None:
        # The data module owns the vocabulary; the model is sized from it.
        parser.link_arguments("data.vocab_size", "model.vocab_size", apply_on="instantiate")
        parser.link_arguments("data.image_size", "model.net.image_size")

    def _use_checkpoint_vocab(self, cfg: Any) -> None:
        """`validate` / `test` of a checkpoint score with its own vocabulary: where the data's
        (`data.vocab_path`, or one built from today's training captions) is another, the
        checkpoint's is written to the run folder (`CHECKPOINT_VOCAB`) and used, unless
        `--data.vocab_path` is given (then the two must agree)."""
        saved = getattr(self, "_checkpoint_vocab", None)
        raw = list(sys.argv[1:] if self._raw_args is None else self._raw_args)
        if saved is None or given(raw, "data.vocab_path"):
            return
        vocab = Vocabulary.from_dict(saved)
        current = cfg["data"].get("vocab_path")
        with contextlib.suppress(OSError, ValueError):
            if current and Vocabulary.load(current) == vocab:
                return
        root = Path(str(cfg.get("trainer", {}).get("default_root_dir") or "."))
        root.mkdir(parents=True, exist_ok=True)
        cfg["data"]["vocab_path"] = str(write_json_atomic(root / CHECKPOINT_VOCAB,
                                                          vocab.to_dict()))
        log.info("scoring with the checkpoint's vocabulary (%d words), not data.vocab_path's "
                 "(%s): %s", len(vocab), current, cfg["data"]["vocab_path"])

    def _apply_init_from(self) -> None:
        """`model.init_from: CKPT` (a checkpoint file or an exported model folder): its network
        (`net`) replaces the config's as with `--ckpt_path` (a `--model.net.*` flag that
        disagrees is an error; `USER_WINS` settings the user gave win), and its other model
        settings apply where the config leaves them unset, except `INIT_FROM_KEEPS`. Its
        vocabulary becomes the data module's (`INIT_FROM_VOCAB` in the run folder), unless
        `data.vocab_path` is given (then the two must agree). Only its weights are loaded, once
        the model is built: no optimiser, loop or baseline state. A run with `--ckpt_path`
        (resuming) restores everything from that checkpoint and ignores `init_from`."""
        sub = self.subcommand
        cfg = self.config[sub] if sub else None
        path = cfg.get("model.init_from") if cfg is not None else None
        if sub == "fit" and cfg.get("model.objective") == "scst" and not (
                path or cfg.get("ckpt_path")):
            log.warning("objective scst without model.init_from: SCST from untrained weights")
        if not path or cfg.get("ckpt_path"):
            return
        loaded = load_checkpoint(path)  # the one safe reader: missing or unsafe -> one line
        data = {} if Path(path).is_dir() else read_checkpoint(path, mmap=True)
        hp = read_config(Path(path) / CONFIG_FILE)[2] if Path(path).is_dir() else \
            upgrade_hparams(data.get("hyper_parameters") or {})
        self._init_carving = carving_record(loaded.captioner.trained_on, str(path)) \
            if Path(path).is_dir() else \
            {k: data[k] for k in ("datamodule_hyper_parameters", CARVING_KEY) if k in data}
        raw = list(sys.argv[1:] if self._raw_args is None else self._raw_args)
        carried = {k: v for k, v in hp.items() if k not in (*INIT_FROM_KEEPS, "net", "decode")
                   and k in cfg["model"] and not given(raw, f"model.{k}")}
        self._apply_hparams(sub, {**carried, "net": {**loaded.config.to_dict(), "weights": None},
                                  "decode": loaded.decode.to_dict()}, path, "model.init_from")
        if not given(raw, "data.vocab_path"):
            root = Path(str(self.config[sub].get("trainer.default_root_dir") or "."))
            root.mkdir(parents=True, exist_ok=True)
            self.config[sub]["data"]["vocab_path"] = str(write_json_atomic(
                root / INIT_FROM_VOCAB, loaded.vocab.to_dict()))
        self._init_from: LoadedModel | None = loaded
        log.info("model.init_from %s: its network, vocabulary (%d words) and weights", path,
                 len(loaded.vocab))

    def after_instantiate_classes(self) -> None:
        """`model.init_from`: the checkpoint's weights into the built model (see above). The
        carving of the run behind `init_from`'s weights or an exported folder's is checked
        against this data, once it is read (a checkpoint's own: as it loads)."""
        if getattr(self, "_init_carving", None):
            self.datamodule.records("train")
            check_carving(self._init_carving, self.datamodule)
        loaded = getattr(self, "_init_from", None)
        if loaded is None:
            return
        self._init_from = None
        if self.datamodule.vocab != loaded.vocab:
            raise CheckpointError(
                f"model.init_from {loaded.path}: its vocabulary ({len(loaded.vocab)} words) "
                f"differs from data.vocab_path's ({len(self.datamodule.vocab)} words); drop "
                "data.vocab_path to use the checkpoint's")
        self.model.captioner.load_state_dict(loaded.captioner.state_dict())

    def __init__(self, *args: Any, claims: contextlib.ExitStack | None = None,
                 **kwargs: Any) -> None:
        self._claims = claims
        self._run_root: Path | None = None  # held by this command: its data problems go there
        try:
            super().__init__(*args, **kwargs)
        except DataError as e:  # every problem listed in the run folder (the message has ten)
            if self._run_root is None or not self.subcommand:
                raise
            # what was skipped before the stop (the data module may not be the CLI's yet)
            skipped = [*e.skipped, *getattr(getattr(self, "datamodule", None), "problems", [])]
            problems = list(dict.fromkeys([*skipped, *e.problems]))
            saved = save_problems(self._run_root, self.subcommand, problems, "stopped")
            raise DataError(e.problems, listed_in=saved) from None

    def before_instantiate_classes(self) -> None:
        cfg = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        root = cfg.get("trainer", {}).get("default_root_dir")
        if self.subcommand and root and self._claims is not None and launcher_rank_zero():
            # one run per run folder: a second one would mix its files with this one's (the
            # other processes of a DDP run are the same run: global rank zero holds it). Held
            # before anything is written there (init_from's vocabulary).
            self._claims.enter_context(claim_folder(root))
            self._run_root = Path(str(root))
        if self.subcommand == "fit" and root and self._claims is not None \
                and launcher_rank_zero():  # checkpoint folders outside it: held too
            for folder in folders_outside(cfg.get("trainer", {}), root):
                self._claims.enter_context(claim_folder(folder, what="checkpoint folder",
                                                        beside=True))
        self._use_checkpoint_vocab(cfg)
        self._apply_init_from()
        logger = cfg.get("trainer", {}).get("logger")
        for lg in logger if isinstance(logger, list) else [logger]:
            if hasattr(lg, "get") and "Wandb" in str(lg.get("class_path", "")):
                save_dir = lg.get("init_args", {}).get("save_dir") or "."
                Path(save_dir).mkdir(parents=True, exist_ok=True)
                for k, v in wandb_dirs(save_dir).items():
                    os.environ.setdefault(k, v)
                    Path(v).mkdir(parents=True, exist_ok=True)


def lightning_cli(args: Sequence[str] | None, *, run: bool = True,
                  claims: contextlib.ExitStack | None = None) -> CaptioningCLI:
    """Build (and with `run`, run) the CLI on `args` (None: `sys.argv`). A config flag may name
    a shipped config (`--config paper_soft`). Parse errors raise `ArgumentError`, reported in
    one line, instead of printing the usage and exiting. The run folder is held until the
    command returns, or with `claims` until the caller closes that stack (a test after it)."""
    # No prefix matching: `--trainer.max_epoch 2` is an error, as the same key in YAML is.
    no_exit = {"exit_on_error": False, "allow_abbrev": False}
    args = resolve_config_args(sys.argv[1:] if args is None else args)
    with contextlib.ExitStack() as own:  # the run folder, held while the command runs
        return CaptioningCLI(
            CaptioningModule,
            CaptionDataModule,
            save_config_kwargs={"overwrite": True},
            parser_kwargs={**no_exit, **{c: dict(no_exit) for c in LIGHTNING_COMMANDS}},
            args=args,
            run=run,
            claims=own if claims is None else claims,
        )
