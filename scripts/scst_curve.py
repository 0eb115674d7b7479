"""Self-critical training on the shapes demo over several seeds: the test figures before and
after SCST, and a learning curve of val CIDEr against SCST steps.

    python scripts/scst_curve.py --seeds 0 1 2 --every 50

For each seed, `captioning demo --scst --seed_everything SEED --curve-every N` in
`RUN_ROOT/seedSEED` (a seed whose SCST test figures exist is not trained again: an
interrupted run resumes with the next seed). Then each kept SCST checkpoint, and the
cross-entropy model as step 0, is validated through `captioning fit`'s own model and data
(pycocoevalcap's CIDEr-D, the figure the demo logs as val/CIDEr). Writes to --out:
`results.csv` (per seed: test figures of both stages), `curve.csv` (seed, step, val figures),
`table.md` (mean ± sd over seeds) and `curve.png`. Arguments after `--` go to the demo.
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

log = logging.getLogger("scst_curve")

METRICS = ("BLEU-4", "METEOR", "CIDEr", "objects_correct", "pointing_accuracy")


def train_seed(run: Path, seed: int, every: int, demo_args: list[str]) -> None:
    """The demo's two stages for one seed, unless its SCST test figures exist."""
    from captioning.evaluation import results_files

    if results_files(run / "scst", "test")[1].is_file():
        log.info("seed %d: trained already (%s)", seed, run)
        return
    cmd = [sys.executable, "-m", "captioning.cli", "demo", "--scst", "--run-dir", str(run),
           "--curve-every", str(every), "--seed_everything", str(seed), *demo_args]
    log.info("seed %d: %s", seed, " ".join(cmd[2:]))
    subprocess.run(cmd, check=True)


def step_of(path: Path) -> int:
    """The step in a curve checkpoint's name, `step=00050.ckpt`."""
    return int(path.stem.split("=")[-1].split("-")[0])


def validate(config: Path, ckpts: list[Path], work: Path) -> list[dict[str, float]]:
    """Val figures of each checkpoint, through the run's own model and data settings."""
    import yaml

    from captioning.commands.lightning import lightning_cli

    work.mkdir(parents=True, exist_ok=True)
    saved = yaml.safe_load(config.read_text())  # `fit`'s saved config, less the fit-only keys
    settings = work / "config.yaml"
    settings.write_text(yaml.safe_dump({k: saved[k] for k in ("seed_everything", "trainer",
                                                              "model", "data") if k in saved}))
    cli = lightning_cli(["--config", str(settings), "--trainer.logger", "false",
                         "--trainer.enable_progress_bar", "false",
                         "--trainer.default_root_dir", str(work),
                         "--model.results_dir", str(work)], run=False)
    out = []
    for ck in ckpts:
        res = cli.trainer.validate(cli.model, datamodule=cli.datamodule, verbose=False,
                                   ckpt_path=str(ck), weights_only=True)
        out.append({k.removeprefix("val/"): float(v) for k, v in res[0].items()})
    return out


def seed_curve(run: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, val figures): the cross-entropy model (step 0), then every kept SCST checkpoint."""
    import yaml

    config = run / "scst" / "config.yaml"
    start = Path(yaml.safe_load(config.read_text())["model"]["init_from"])  # the CE weights
    ckpts = sorted((run / "scst" / "curve").glob("*.ckpt"), key=step_of)
    with tempfile.TemporaryDirectory(prefix="scst-curve-") as tmp:
        figures = validate(config, [start, *ckpts], Path(tmp))
    return list(zip([0, *map(step_of, ckpts)], figures))


def test_figures(folder: Path) -> dict[str, float]:
    from captioning.evaluation import results_files

    metrics = json.loads(results_files(folder, "test")[1].read_text())
    return {k: float(v) for k, v in metrics.items() if k in METRICS}


def mean_sd(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def write_outputs(out: Path, results: dict[int, dict[str, dict[str, float]]],
                  curves: dict[int, list[tuple[int, dict[str, float]]]]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "stage", *METRICS])
        for seed, stages in sorted(results.items()):
            for stage, figs in stages.items():
                w.writerow([seed, stage, *(f"{figs.get(m, float('nan')):.4f}" for m in METRICS)])
    with open(out / "curve.csv", "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["seed", "step", "val_CIDEr", "val_BLEU-4", "val_objects_correct"])
        for seed, points in sorted(curves.items()):
            for step, v in points:
                w.writerow([seed, step, *(f"{v.get(k, float('nan')):.4f}"
                                          for k in ("CIDEr", "BLEU-4", "objects_correct"))])
    n = len(results)
    lines = [f"Test split, {n} seed{'s' if n != 1 else ''} (mean ± sd)", "",
             "| metric | cross-entropy | after SCST | change (mean of per-seed changes) |",
             "|---|---|---|---|"]
    for m in METRICS:  # the seeds that have the metric in both stages (pointing may be absent)
        pairs = [(r["cross_entropy"][m], r["scst"][m]) for r in results.values()
                 if m in r["cross_entropy"] and m in r["scst"]]
        if not pairs:
            continue
        ce, sc = [a for a, _ in pairs], [b for _, b in pairs]
        rel = [100 * (b - a) / a for a, b in pairs if a]
        change = f"{statistics.mean(b - a for a, b in pairs):+.4f}"
        if m == "CIDEr" and rel:
            change += f" ({statistics.mean(rel):+.1f}% relative)"
        lines.append(f"| {m} | {mean_sd(ce)} | {mean_sd(sc)} | {change} |")
    (out / "table.md").write_text("\n".join(lines) + "\n")
    plot(out / "curve.png", curves)


COLOURS = ((31, 119, 180), (255, 127, 14), (44, 160, 44), (214, 39, 40), (148, 103, 189))


def plot(path: Path, curves: dict[int, list[tuple[int, dict[str, float]]]]) -> None:
    """val CIDEr against SCST steps, a line per seed (PIL: no plotting library needed)."""
    from PIL import Image, ImageDraw, ImageFont

    W, H, left, right, top, bottom = 640, 380, 64, 110, 36, 48
    font = ImageFont.load_default(size=12)
    pts = [(s, v["CIDEr"]) for points in curves.values() for s, v in points]
    x1 = max(1, max(s for s, _ in pts))
    y0, y1 = min(c for _, c in pts), max(c for _, c in pts)
    pad = 0.05 * (y1 - y0 or 1.0)
    y0, y1 = y0 - pad, y1 + pad
    img = Image.new("RGB", (W, H), "white")
    d = ImageDraw.Draw(img)

    def xy(step: float, value: float) -> tuple[float, float]:
        return (left + (W - left - right) * step / x1,
                H - bottom - (H - top - bottom) * (value - y0) / (y1 - y0))

    d.rectangle([left, top, W - right, H - bottom], outline="black")
    for k in range(5):  # ticks: 5 on each axis
        v, st = y0 + (y1 - y0) * k / 4, x1 * k / 4
        d.text((4, xy(0, v)[1] - 7), f"{v:.2f}", fill="black", font=font)
        d.line([left - 4, xy(0, v)[1], left, xy(0, v)[1]], fill="black")
        d.text((xy(st, y0)[0] - 10, H - bottom + 6), f"{st:.0f}", fill="black", font=font)
    d.text((left, 10), "SCST on the shapes demo: val CIDEr-D (step 0: cross-entropy model)",
           fill="black", font=font)
    d.text((W // 2 - 60, H - 20), "SCST training steps", fill="black", font=font)
    for n, (seed, points) in enumerate(sorted(curves.items())):
        colour = COLOURS[n % len(COLOURS)]
        line = [xy(s, v["CIDEr"]) for s, v in points]
        d.line(line, fill=colour, width=2)
        for x, y in line:
            d.ellipse([x - 3, y - 3, x + 3, y + 3], fill=colour)
        d.text((W - right + 12, top + 18 * n), f"seed {seed}", fill=colour, font=font)
    img.save(path, format="PNG")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    demo_args = argv[argv.index("--") + 1:] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--every", type=int, default=50, help="keep the SCST weights every N steps")
    p.add_argument("--run-root", default="runs/scst-seeds")
    p.add_argument("--out", default="docs/scst")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    results: dict[int, dict[str, dict[str, float]]] = {}
    curves: dict[int, list[tuple[int, dict[str, Any]]]] = {}
    for seed in args.seeds:
        run = Path(args.run_root) / f"seed{seed}"
        train_seed(run, seed, args.every, demo_args)
        results[seed] = {"cross_entropy": test_figures(run), "scst": test_figures(run / "scst")}
        curves[seed] = seed_curve(run)
        write_outputs(Path(args.out), results, curves)  # after every seed: nothing lost
    print((Path(args.out) / "table.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
