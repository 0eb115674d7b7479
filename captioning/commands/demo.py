"""`captioning demo`: generate shapes, train on the CPU, test, print metrics and captions.

`--scst` adds a second stage: self-critical sequence training from the first stage's checkpoint
(best by val BLEU-4, else the last), for at most its epochs and training time; then the test
figures of both stages side by side."""

from __future__ import annotations

import argparse
import logging
import math
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from captioning.atomic import write_text_atomic
from captioning.commands.configs import CONFIG_DIR, trainer_config_in
from captioning.commands.errors import ConfigError
from captioning.commands.lightning import lightning_cli

log = logging.getLogger(__name__)

#: The SCST stage's data settings (before the user's flags, which win): 32 caption pairs a step,
#: about 32 images and 5 samples of each. On the val split, 100 such steps gave a higher CIDEr
#: and objects correct (5.33, 0.856) than 50 steps of the cross-entropy stage's 128 pairs (5.15,
#: 0.824), which see more images and take longer.
SCST_DATA = ("--data.batch_size", "32")

METRIC_ORDER = ("BLEU-1", "BLEU-2", "BLEU-3", "BLEU-4", "METEOR", "ROUGE-L", "CIDEr",
                "objects_correct", "pointing_accuracy")


def demo_configs(attention: str) -> list[Path]:
    return [CONFIG_DIR / "trainer" / "cpu.yaml", CONFIG_DIR / "data" / "shapes.yaml",
            CONFIG_DIR / "model" / f"demo_{attention}.yaml"]


def report(metrics: dict[str, float], samples: Sequence[tuple[Any, str, list[str]]],
           *, seconds: float, out: Any = sys.stdout, title: str = "Shapes test split") -> None:
    """The demo's printed summary: metrics, then generated captions beside references."""
    out.write(f"\n{title} ({seconds / 60:.1f} min)\n")
    for name in METRIC_ORDER:
        if name in metrics:
            out.write(f"  {name:<18} {metrics[name]:.4f}\n")
    out.write("\nGenerated captions beside their references:\n")
    for image_id, hyp, refs in samples:
        out.write(f"  [{image_id}] {hyp}\n")
        for r in refs[:2]:
            out.write(f"        ref: {r}\n")
    out.flush()


def compare(before: dict[str, float], after: dict[str, float], *, out: Any = sys.stdout) -> None:
    """Both stages' test figures side by side (`--scst`)."""
    out.write(f"\nShapes test split  {'cross-entropy':>13} {'SCST':>7} {'change':>7} "
              f"{'relative':>8}\n")
    for name in METRIC_ORDER:
        if name in before and name in after:
            a, b = before[name], after[name]
            rel = f"{(b - a) / abs(a):+.1%}" if a else "n/a"
            out.write(f"  {name:<17} {a:>13.4f} {b:>7.4f} {b - a:>+7.4f} {rel:>8}\n")
    out.flush()


@dataclass
class Stage:
    """What one demo stage leaves: its test figures, its training time and its checkpoint."""

    metrics: dict[str, float]
    train_seconds: float
    checkpoint: str | None


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="captioning demo",
                                description="Train and evaluate on the synthetic shapes data.")
    p.add_argument("--attention", choices=("soft", "hard"), default="soft")
    p.add_argument("--run-dir", default=None, help="default: runs/demo-<attention>")
    p.add_argument("--samples", type=int, default=6, help="captions to print")
    p.add_argument("--scst", action="store_true",
                   help="then self-critical sequence training (configs/model/demo_soft_scst.yaml)"
                        " from the cross-entropy checkpoint, for at most as long as "
                        "cross-entropy trained; prints the test figures of both")
    p.add_argument("--curve-every", type=int, default=0, metavar="N",
                   help="with --scst: also keep the SCST weights every N steps in "
                        "RUN_DIR/scst/curve, for a learning curve (scripts/scst_curve.py)")
    p.epilog = "Other arguments go to LightningCLI (both stages), e.g. --trainer.max_epochs 2"
    a, overrides = p.parse_known_args(argv)
    run_dir = Path(a.run_dir or f"runs/demo-{a.attention}")
    ce = run_stage(run_dir, demo_configs(a.attention)[1:], overrides, a.samples)
    if not a.scst:
        return 0
    if ce.checkpoint is None:
        raise ConfigError("demo --scst: the cross-entropy stage saved no checkpoint to start from")
    _finish_wandb_run()  # each stage has its own W&B run
    # The network, vocabulary and decoding come from the checkpoint (also for hard attention);
    # at most the cross-entropy stage's epochs (the same trainer settings) and training time.
    configs = [CONFIG_DIR / "data" / "shapes.yaml", CONFIG_DIR / "model" / "demo_soft_scst.yaml"]
    budget = ["--model.init_from", ce.checkpoint,
              "--trainer.max_time", _duration(ce.train_seconds)]
    scst = run_stage(run_dir / "scst", configs, [*SCST_DATA, *overrides, *budget], a.samples,
                     title="Shapes test split after SCST", keep_every=a.curve_every)
    compare(ce.metrics, scst.metrics)
    return 0


def run_stage(run_dir: Path, configs: Sequence[Path], overrides: Sequence[str], samples: int,
              *, title: str = "Shapes test split", keep_every: int = 0) -> Stage:
    """`captioning fit` with the demo trainer in `run_dir`, then test the best checkpoint (the
    final weights when none was kept) and print the figures and a few captions."""
    start = time.perf_counter()
    args: list[str] = ["fit"]
    for cfg in [_trainer_config(run_dir, keep_every=keep_every), *configs]:
        args += ["--config", str(cfg)]
    cli = lightning_cli([*args, *overrides])
    trainer, model, dm = cli.trainer, cli.model, cli.datamodule
    train_seconds = _train_seconds(trainer, time.perf_counter() - start)
    ckpt = trainer.checkpoint_callback
    best = ckpt.best_model_path if ckpt is not None and ckpt.best_model_path else None
    last = next((c.last_model_path for c in trainer.checkpoint_callbacks
                 if getattr(c, "last_model_path", "")), None)
    trainer.test(model, datamodule=dm, ckpt_path=best, weights_only=True)
    results = model.test_results
    ids = list(results.hypotheses)[:samples]
    shown = [(i, results.hypotheses[i], results.references.get(i, [])) for i in ids]
    report(results.metrics, shown, seconds=time.perf_counter() - start, title=title)
    return Stage(results.metrics, train_seconds, best or last)


def _train_seconds(trainer: Any, fallback: float) -> float:
    """The training loop's time by Lightning's `Timer` (what `max_time` limits), else `fallback`."""
    from lightning.pytorch.callbacks import Timer

    timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
    elapsed = timer.time_elapsed("train") if timer is not None else 0.0
    return elapsed if elapsed > 0 else fallback


def _finish_wandb_run() -> None:
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def _duration(seconds: float) -> str:
    """`trainer.max_time` of at least one second: DD:HH:MM:SS."""
    s = max(1, math.ceil(seconds))
    return f"{s // 86400:02d}:{s // 3600 % 24:02d}:{s // 60 % 60:02d}:{s % 60:02d}"


def _trainer_config(run_dir: Path, *, keep_every: int = 0) -> Path:
    """The demo trainer config with every output folder moved into `run_dir`; with
    `keep_every` N, the weights are also kept every N steps in `run_dir/curve`."""
    import yaml

    cfg = trainer_config_in(CONFIG_DIR / "trainer" / "cpu.yaml", run_dir)
    if keep_every > 0:
        cfg["trainer"]["callbacks"].append({
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(run_dir / "curve"), "filename": "{step:05d}",
                          "every_n_train_steps": keep_every, "save_top_k": -1,
                          "save_weights_only": True}})
    run_dir.mkdir(parents=True, exist_ok=True)
    return write_text_atomic(run_dir / "trainer.yaml", yaml.safe_dump(cfg, sort_keys=False))
