"""The `captioning` command: dispatch to a command module, exit statuses, the W&B run's end.

* `captioning fit|validate|test --config configs/... [--data.source.root ...]`  (LightningCLI)
* `captioning demo [--attention soft|hard]`  generate shapes, train, test, print results
* `captioning shapes --root DIR`  write the synthetic shapes dataset
* `captioning caption --checkpoint CKPT IMAGE ...`  caption images with a checkpoint
* `captioning cache-features --config ...`  build the frozen-encoder feature cache ahead of time
* `captioning predict --checkpoint CKPT|DIR IMAGE|DIR|GLOB|LIST ...`  caption many images
  through Lightning (one GPU or many), writing COCO results JSON
* `captioning score RESULTS.json --references FILE`  coco-caption scores of a results file
* `captioning export --checkpoint CKPT --out DIR`  a shareable model folder (safetensors, JSON)
* `captioning configs`  list the configs shipped inside the package

`captioning --import MODULE COMMAND ...` imports a module of one's own first (a scorer named by
its import path, `model.net.score`); `ablate` passes it on to its cells.

Each command lives in `captioning.commands`; heavy imports (torch, lightning) happen inside
them, so `--help` and `caption` start fast. User errors and interruptions end in one line
(`captioning.commands.errors`).
"""

from __future__ import annotations

import importlib
import logging
import sys
import warnings
from collections.abc import Sequence

from captioning.allocator import keep_freed_memory
from captioning.commands.errors import ConfigError, exit_status
from captioning.locks import sigterm_raises

#: Commands other than LightningCLI's, by the module under `captioning.commands` that runs them.
COMMANDS = {"caption": "caption", "demo": "demo", "shapes": "shapes",
            "cache-features": "cache_features", "predict": "predict", "export": "export",
            "configs": "configs", "ablate": "ablate", "score": "score"}
NO_WANDB = frozenset({"caption", "shapes", "export", "configs", "score"})
#: Commands that train through Lightning, which handles SIGTERM itself (`CheckpointOnInterrupt`).
LIGHTNING_RUNS = frozenset({"demo", "ablate"})
#: Library messages about the project's own wiring, not the user's run: Lightning's
#: advertisements and its note that the module's own callbacks (the Gumbel τ schedule) replace
#: those of an earlier fit in the same process, the frozen encoder being in eval mode (on
#: purpose), and an internal deprecation between Lightning and torch.
QUIET = ("💡 Tip:", "`LightningModule.configure_callbacks` will override",
         "module(s) in eval mode at the start of training",
         "isinstance(treespec, LeafSpec)` is deprecated")


class _Quiet(logging.Filter):
    """Drops `QUIET` messages; on the root handler, also Lightning's records, which Lightning's
    own console handler already prints (each line once)."""

    def __init__(self, *, lightning: bool) -> None:
        super().__init__()
        self.lightning = lightning

    def filter(self, record: logging.LogRecord) -> bool:
        if self.lightning and record.name.partition(".")[0] == "lightning":
            return False
        message = str(record.msg)
        return not any(q in message for q in QUIET)


def configure_logging() -> None:
    """INFO to stderr, each line once, without the `QUIET` messages."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, _Quiet) for f in handler.filters):
            handler.addFilter(_Quiet(lightning=True))
    rank_zero = logging.getLogger("lightning.pytorch.utilities.rank_zero")
    if not any(isinstance(f, _Quiet) for f in rank_zero.filters):
        rank_zero.addFilter(_Quiet(lightning=False))  # before it reaches Lightning's handler
    for q in QUIET[2:]:
        warnings.filterwarnings("ignore", message=f".*{q.replace('(', '.').replace(')', '.')}")


def _finish_wandb(failed: bool) -> None:
    """End the W&B run a command started, so that the next command in this process (tests,
    notebooks) starts its own instead of reusing it."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish(exit_code=1 if failed else 0)


USAGE = """usage: captioning [--import MODULE ...] COMMAND [ARGS]   (COMMAND --help: its options)

Training and evaluation (LightningCLI):
  fit, validate, test   --config NAME|FILE ... [--data.source.root DIR] [--ckpt_path CKPT]
Commands:
  demo            generate the shapes data, train, test and print the results
  caption         caption images with a checkpoint or an exported model folder
  predict         caption many images through Lightning (one GPU or many): COCO results JSON
  score           coco-caption scores (BLEU, METEOR, ROUGE-L, CIDEr-D) of a results JSON
  export          a shareable model folder (safetensors, config.json, vocab.json, model card)
  cache-features  build the frozen encoder's feature cache ahead of time
  shapes          write the synthetic shapes dataset
  configs         list the configs shipped with the package (give --config one by name)
  ablate          train and test every variant × seed of an ablation grid: CSV, table, plot
"""


def split_imports(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """(the modules of the `--import MODULE` options before the command, the rest)."""
    modules, rest = [], list(argv)
    while rest and (rest[0] == "--import" or rest[0].startswith("--import=")):
        name, rest = (rest[1:2], rest[2:]) if rest[0] == "--import" else \
            ([rest[0].partition("=")[2]], rest[1:])
        if not name or not name[0]:
            raise ConfigError("--import: expected a module name")
        modules += name
    return modules, rest


def import_modules(modules: Sequence[str]) -> None:
    """Import each module of `--import`, or stop in one line naming it."""
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise ConfigError(f"--import {name}: cannot import it ({e})") from None


def _dispatch(argv: list[str], imports: Sequence[str] = ()) -> int:
    command = argv[0] if argv else ""
    if command in ("", "-h", "--help"):
        (sys.stdout if command else sys.stderr).write(USAGE)
        return 0 if command else 2
    if command in COMMANDS:
        module = importlib.import_module(f"captioning.commands.{COMMANDS[command]}")
        if command == "ablate":  # its cells run in child processes, which import them too
            argv = [command, *(a for m in imports for a in ("--import", m)), *argv[1:]]
        if command in LIGHTNING_RUNS:  # Lightning's own SIGTERM handling (a checkpoint first)
            return int(module.main(argv[1:]))
        with sigterm_raises():  # SIGTERM like Ctrl-C: clean-up runs, one line, exit 143
            return int(module.main(argv[1:]))
    from captioning.commands.lightning import lightning_cli

    lightning_cli(argv)
    return 0


def _run(argv: list[str]) -> int:
    imports, argv = split_imports(argv)
    import_modules(imports)
    if not argv or argv[0] in NO_WANDB or argv[0].startswith("-"):
        return _dispatch(argv, imports)
    try:
        status = _dispatch(argv, imports)
    except BaseException:
        _finish_wandb(failed=True)
        raise
    _finish_wandb(failed=False)
    return status


def main(argv: Sequence[str] | None = None) -> int:
    """Run a `captioning` command; returns its exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    configure_logging()
    keep_freed_memory()  # a training step's tensors reuse freed memory (captioning.allocator)
    try:
        return _run(argv)
    except BaseException as e:
        status = exit_status(e)
        if status is None:
            raise
        return status


if __name__ == "__main__":
    sys.exit(main())
