"""The `captioning` command.

* `captioning fit|validate|test --config configs/... [--data.root ...]`  (LightningCLI)
* `captioning demo [--attention soft|hard]`  generate shapes, train, test, print results
* `captioning shapes --root DIR`  write the synthetic shapes dataset
* `captioning caption --checkpoint CKPT IMAGE ...`  caption images with a checkpoint
* `captioning cache-features --config ...`  build the frozen-encoder feature cache ahead of time

Heavy imports (torch, lightning) happen inside the commands, so `--help` and `caption` start fast.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger("captioning")

CONFIG_DIR = Path(__file__).resolve().parent.parent / "configs"
LIGHTNING_COMMANDS = ("fit", "validate", "test", "predict")


def wandb_dirs(run_dir: str | Path) -> dict[str, str]:
    """W&B's own folders, all inside the run folder (offline runs leave nothing elsewhere)."""
    base = Path(run_dir).resolve()
    return {
        "WANDB_DIR": str(base),
        "WANDB_DATA_DIR": str(base / "wandb-data"),
        "WANDB_CACHE_DIR": str(base / "wandb-cache"),
        "WANDB_CONFIG_DIR": str(base / "wandb-config"),
    }


def _lightning_cli(args: Sequence[str] | None, *, run: bool = True) -> Any:
    from lightning.pytorch.cli import LightningCLI

    from captioning.data.datamodule import CaptionDataModule
    from captioning.lit_module import CaptioningModule

    class CaptioningCLI(LightningCLI):
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

    return CaptioningCLI(
        CaptioningModule,
        CaptionDataModule,
        save_config_kwargs={"overwrite": True},
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


def main(argv: Sequence[str] | None = None) -> int:
    from_shell = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    command = argv[0] if argv else ""
    try:
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
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    _lightning_cli(None if from_shell else argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
