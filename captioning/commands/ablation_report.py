"""The ablation's files: results.csv (one row per cell), and the summary over seeds per
variant as a Markdown table and a PNG.

The sd is the sample standard deviation (n − 1) over the seeds that finished; a variant with one
finished seed shows its value alone. Failed cells are counted per variant and listed with their
errors under the table. The plot is drawn with Pillow (no matplotlib needed): one panel per
metric, a horizontal bar per variant at its mean, and a whisker of ± one sd.
"""

from __future__ import annotations

import csv
import io
import math
import signal
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from captioning.atomic import write_atomic, write_text_atomic

#: Metrics that are not test metrics: from the validation pass (`val/NAME`) or the cell itself.
CELL_METRICS = ("train_seconds", "alpha_entropy")
#: Column headers of the metrics the ablation knows; others read `test NAME`.
LABELS = {"train_seconds": "training time (s)", "alpha_entropy": "α entropy (nats)",
          "objects_correct": "test objects correct", "pointing_accuracy": "test pointing accuracy"}


@dataclass
class Summary:
    """One variant over its seeds."""

    variant: str
    ok: int = 0
    total: int = 0
    failed: list[tuple[int, str]] = field(default_factory=list)  # (seed, error)
    mean: dict[str, float] = field(default_factory=dict)
    sd: dict[str, float] = field(default_factory=dict)


def cell_metrics(result: dict[str, Any], metrics: Sequence[str]) -> dict[str, float]:
    """The grid's metrics from a cell's result file: test metrics by name, `val/NAME`, or a
    cell figure (`train_seconds`, `alpha_entropy`); NaN where absent."""
    out = {}
    for m in metrics:
        if m in CELL_METRICS:
            value = result.get(m)
        elif m.startswith("val/"):
            value = result.get("val", {}).get(m[4:])
        else:
            value = result.get("test", {}).get(m)
        out[m] = math.nan if value is None else float(value)
    return out


def unreported_metrics(rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> list[str]:
    """The `metrics` that no finished (`ok`) row has a value of."""
    done = [r for r in rows if r.get("status") == "ok"]
    return [m for m in metrics if done and all(
        not isinstance(r.get(m), float) or math.isnan(r[m]) for r in done)]


def error_line(log_text: str, returncode: int) -> str:
    """The child's one-line error: its `error: ...` line, else the traceback's last line; for
    a child killed by a signal (a negative `returncode`), that signal."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        return f"killed by {name}"
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if ln.startswith("error: "):
            return ln.removeprefix("error: ")
    for ln in reversed(lines):
        if not ln.startswith(("wandb:", "INFO", "WARNING", "  ")):
            return ln[:300]
    return f"exit status {returncode}"


def columns(metrics: Sequence[str]) -> list[str]:
    return ["variant", "seed", "status", "error", *metrics, "seconds", "config", "code"]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """results.csv as rows (seed as int, metrics as floats); none when it does not exist."""
    if not path.is_file():
        return []
    rows = []
    for row in csv.DictReader(io.StringIO(path.read_text())):
        for key, value in row.items():
            if key == "seed":
                row[key] = int(value)
            elif key not in ("variant", "status", "error", "config", "code"):
                row[key] = float(value) if value not in ("", None) else math.nan
        rows.append(row)
    return rows


def write_rows(path: Path, rows: Sequence[dict[str, Any]], metrics: Sequence[str]) -> None:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=columns(metrics), extrasaction="ignore",
                            lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: ("" if isinstance(v, float) and math.isnan(v) else v)
                         for k, v in row.items()})
    write_text_atomic(path, buf.getvalue())


def label(metric: str) -> str:
    if metric in LABELS:
        return LABELS[metric]
    if metric.startswith("val/"):
        return f"val {metric[4:]}"
    return f"test {metric.replace('_', ' ')}"


def summarise(rows: Sequence[dict[str, Any]], variants: Sequence[str],
              metrics: Sequence[str]) -> list[Summary]:
    """Per variant (in `variants` order, those with rows): mean and sd of each metric over its
    `ok` rows, ignoring missing values, and its failed seeds."""
    out = []
    for variant in variants:
        mine = [r for r in rows if r["variant"] == variant]
        if not mine:
            continue
        s = Summary(variant, total=len(mine))
        ok = [r for r in mine if r["status"] == "ok"]
        s.ok = len(ok)
        s.failed = [(int(r["seed"]), str(r.get("error") or "")) for r in mine
                    if r["status"] != "ok"]
        for m in metrics:
            values = [float(r[m]) for r in ok if not math.isnan(float(r.get(m, math.nan)))]
            s.mean[m] = statistics.fmean(values) if values else math.nan
            s.sd[m] = statistics.stdev(values) if len(values) > 1 else math.nan
        out.append(s)
    return out


def fmt(value: float, metric: str) -> str:
    if math.isnan(value):
        return "–"
    return f"{value:.0f}" if metric == "train_seconds" else f"{value:.3f}"


def cell_text(s: Summary, metric: str) -> str:
    """`mean ± sd`, the mean alone for one seed, `–` for none."""
    mean, sd = s.mean[metric], s.sd[metric]
    if math.isnan(sd):
        return fmt(mean, metric)
    return f"{fmt(mean, metric)} ± {fmt(sd, metric)}"


def table_markdown(grid: str, rows: Sequence[dict[str, Any]], variants: Sequence[str],
                   metrics: Sequence[str]) -> str:
    """The Markdown table, then the failed cells with their errors."""
    summaries = summarise(rows, variants, metrics)
    lines = [f"# Ablation `{grid}`", "",
             "Mean ± sd over seeds (sample sd; `ok`: seeds that finished, of those run). "
             "Written by `captioning ablate` from results.csv.", "",
             "| variant | ok | " + " | ".join(label(m) for m in metrics) + " |",
             "|---|---|" + "---|" * len(metrics)]
    for s in summaries:
        lines.append(f"| {s.variant} | {s.ok}/{s.total} | "
                     + " | ".join(cell_text(s, m) for m in metrics) + " |")
    failed = [(s.variant, seed, err) for s in summaries for seed, err in s.failed]
    lines += ["", f"Failed cells: {len(failed)}."]
    lines += [f"- {v} seed {seed}: {err.replace('|', '/')}" for v, seed, err in failed]
    return "\n".join(lines) + "\n"


def write_table(path: Path, grid: str, rows: Sequence[dict[str, Any]], variants: Sequence[str],
                metrics: Sequence[str]) -> Path:
    return write_text_atomic(path, table_markdown(grid, rows, variants, metrics))


# -- the plot ---------------------------------------------------------------------------------

BAR_W, BAR_H, PAD = 300, 18, 10  # bar area width, bar height, padding


def _panel(draw: Any, font: Any, box: tuple[int, int], metric: str,
           summaries: Sequence[Summary], name_w: int) -> None:
    """One metric: a bar per variant (mean) with a ± sd whisker, the value at its end."""
    x0, y0 = box
    draw.text((x0 + PAD, y0 + 2), label(metric).replace("α", "alpha"), fill="black", font=font)
    tops = [s.mean[m] + (0 if math.isnan(s.sd[m]) else s.sd[m])
            for s in summaries for m in [metric] if not math.isnan(s.mean[m])]
    scale_max = max([*tops, 1e-9])
    left, width = x0 + PAD + name_w, BAR_W
    y = y0 + BAR_H + 8
    draw.line([(left, y - 2), (left, y + BAR_H * len(summaries))], fill="black")
    for s in summaries:
        draw.text((x0 + PAD, y + 2), s.variant, fill="black", font=font)
        mean, sd = s.mean[metric], s.sd[metric]
        if not math.isnan(mean):
            end = left + width * max(mean, 0.0) / scale_max
            draw.rectangle([left, y + 3, end, y + BAR_H - 3], fill=(90, 130, 200))
            if not math.isnan(sd):
                lo = left + width * max(mean - sd, 0.0) / scale_max
                hi = left + width * (mean + sd) / scale_max
                mid = y + BAR_H // 2
                draw.line([(lo, mid), (hi, mid)], fill="black", width=2)
                draw.line([(lo, y + 4), (lo, y + BAR_H - 4)], fill="black")
                draw.line([(hi, y + 4), (hi, y + BAR_H - 4)], fill="black")
            draw.text((left + width + 6, y + 2), cell_text(s, metric), fill="black", font=font)
        else:
            draw.text((left + 4, y + 2), "failed" if s.ok == 0 else "–", fill=(180, 0, 0),
                      font=font)
        y += BAR_H


def plot_image(grid: str, rows: Sequence[dict[str, Any]], variants: Sequence[str],
               metrics: Sequence[str]) -> Any:
    """A PIL image: one panel per metric, two panels a row."""
    from PIL import Image, ImageDraw, ImageFont

    summaries = summarise(rows, variants, metrics)
    font = ImageFont.load_default(size=12)
    name_w = int(max([font.getlength(s.variant) for s in summaries] + [40])) + PAD
    cols = min(2, max(1, len(metrics)))
    panel_w = name_w + BAR_W + 110
    panel_h = BAR_H * (len(summaries) + 1) + 2 * PAD + 8
    n_rows = math.ceil(len(metrics) / cols)
    img = Image.new("RGB", (cols * panel_w, 30 + n_rows * panel_h), "white")
    draw = ImageDraw.Draw(img)
    draw.text((PAD, 8), f"Ablation {grid}: mean ± sd over seeds", fill="black", font=font)
    for i, metric in enumerate(metrics):
        box = ((i % cols) * panel_w, 30 + (i // cols) * panel_h)
        _panel(draw, font, box, metric, summaries, name_w)
    return img


def write_plot(path: Path, grid: str, rows: Sequence[dict[str, Any]], variants: Sequence[str],
               metrics: Sequence[str]) -> Path:
    img = plot_image(grid, rows, variants, metrics)
    return write_atomic(path, lambda tmp: img.save(tmp, format="PNG"))
