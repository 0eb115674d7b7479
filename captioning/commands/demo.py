"""`captioning demo`: generate shapes, train on the CPU, test, print metrics and captions."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from captioning.commands.configs import CONFIG_DIR
from captioning.commands.lightning import lightning_cli

log = logging.getLogger(__name__)

METRIC_ORDER = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr",
                "objects_correct", "pointing_accuracy")


def demo_configs(attention: str) -> list[Path]:
    return [CONFIG_DIR / "trainer" / "cpu.yaml", CONFIG_DIR / "data" / "shapes.yaml",
            CONFIG_DIR / "model" / f"demo_{attention}.yaml"]


def report(metrics: dict[str, float], samples: Sequence[tuple[Any, str, list[str]]],
           *, seconds: float, out: Any = sys.stdout) -> None:
    """The demo's printed summary: metrics, then generated captions beside references."""
    out.write(f"\nShapes test split ({seconds / 60:.1f} min)\n")
    for name in METRIC_ORDER:
        if name in metrics:
            out.write(f"  {name:<18} {metrics[name]:.4f}\n")
    out.write("\nGenerated captions beside their references:\n")
    for image_id, hyp, refs in samples:
        out.write(f"  [{image_id}] {hyp}\n")
        for r in refs[:2]:
            out.write(f"        ref: {r}\n")
    out.flush()


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="captioning demo",
                                description="Train and evaluate on the synthetic shapes data.")
    p.add_argument("--attention", choices=("soft", "hard"), default="soft")
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<attention>")
    p.add_argument("--samples", type=int, default=6, help="captions to print")
    p.epilog = "Other arguments go to LightningCLI, e.g. --trainer.max_epochs 2"
    a, overrides = p.parse_known_args(argv)
    run_dir = Path(a.run_dir or f"runs/demo-{a.attention}")
    configs = [_trainer_config(run_dir), *demo_configs(a.attention)[1:]]
    args: list[str] = ["fit"]
    for cfg in configs:
        args += ["--config", str(cfg)]
    args += overrides
    start = time.perf_counter()
    cli = lightning_cli(args)
    trainer, model, dm = cli.trainer, cli.model, cli.datamodule
    ckpt = trainer.checkpoint_callback
    best = ckpt.best_model_path if ckpt is not None and ckpt.best_model_path else None
    trainer.test(model, datamodule=dm, ckpt_path=best, weights_only=True)
    results = model.test_results
    ids = list(results.hypotheses)[: a.samples]
    samples = [(i, results.hypotheses[i], results.references.get(i, [])) for i in ids]
    report(results.metrics, samples, seconds=time.perf_counter() - start)
    return 0


def _trainer_config(run_dir: Path) -> Path:
    """The demo trainer config with every output folder moved into `run_dir`."""
    import yaml

    cfg = yaml.safe_load((CONFIG_DIR / "trainer" / "cpu.yaml").read_text())
    cfg["trainer"]["default_root_dir"] = str(run_dir)
    for lg in cfg["trainer"].get("logger") or []:
        lg.setdefault("init_args", {})["save_dir"] = str(run_dir)
    for cb in cfg["trainer"].get("callbacks") or []:
        if cb.get("class_path", "").endswith("ModelCheckpoint"):
            cb.setdefault("init_args", {})["dirpath"] = str(run_dir / "checkpoints")
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "trainer.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path
