"""`captioning ablate --grid NAME|FILE`: train and test every variant × seed of a YAML grid.

A grid (`configs/ablations/*.yaml`) names the configs and overrides every cell shares
(`base`), the seeds, the variants (name → overrides, optionally with more `configs`) and the
metrics to report. Each cell trains with `captioning fit` in its own run folder
(`runs/ablations/<grid>/<variant>/seed<k>/`), then tests the best checkpoint by val BLEU-4 (the
final weights when no validation ran), in a child process: a crash, an out-of-memory kill or a
bad value fails that cell alone, and every cell starts with a fresh interpreter. The child writes
`cell_result.json` (test and val metrics, training seconds, mean α entropy over the test
captions' steps); the parent writes `results.csv` atomically after every cell, then `table.md`
(mean ± sd over seeds) and `plot.png` (`captioning.commands.ablation_report`).

Resume: a cell whose settings fingerprint (taken before it trains) and code digest (of the
package's source, `captioning.provenance`) still match those of its `ok` row in `results.csv`,
or of its own `cell_result.json` (a `results.csv` lost or written elsewhere), is not retrained,
so running the command again continues an interrupted grid (an unfinished cell starts over). A
result done by other code, or with no digest (older results), trains again unless
`--keep-done`. A failed cell is retried on the next run.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import math
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from captioning.atomic import write_json_atomic, write_text_atomic
from captioning.commands.ablation_grid import Grid, config_file, find_grid, load_grid
from captioning.commands.ablation_report import (
    CELL_METRICS,
    cell_metrics,
    error_line,
    read_rows,
    unreported_metrics,
    write_plot,
    write_rows,
    write_table,
)
from captioning.commands.configs import trainer_config_in
from captioning.commands.errors import ConfigError
from captioning.locks import (
    Terminated,
    claim_folder,
    die_with_parent,
    exclusive_lock,
    sigterm_raises,
)
from captioning.provenance import code_digest

log = logging.getLogger(__name__)

CELL_FILE, RESULT_FILE, LOG_FILE = "cell.json", "cell_result.json", "cell.log"


@dataclass(frozen=True)
class Cell:
    """One variant × seed: its run folder, config files and overrides (flags)."""

    variant: str
    seed: int
    run_dir: Path
    configs: tuple[Path, ...]
    overrides: dict[str, Any] = field(default_factory=dict)
    without: tuple[str, ...] = ()
    imports: tuple[str, ...] = ()  # `captioning --import` modules (a scorer of one's own)

    def command(self, args: Sequence[str]) -> list[str]:
        """`captioning` arguments running `args` in a child process, after the imports."""
        return [*(a for m in self.imports for a in ("--import", m)), *args]

    def fit_args(self) -> list[str]:
        """`captioning fit` arguments; the first config is the cell's own trainer file."""
        args = ["fit", "--config", str(self.run_dir / "trainer.yaml")]
        for cfg in self.configs[1:]:
            args += ["--config", str(cfg)]
        for key, value in self.overrides.items():
            args += [f"--{key}", flag_value(value)]
        return args

    def fingerprint(self) -> str:
        """A short hash of everything that decides the cell's result (config contents, not
        paths or comments): a changed grid or config retrains the cell."""
        data = {"configs": [yaml.safe_load(p.read_text()) for p in self.configs],
                "overrides": {k: v for k, v in self.overrides.items() if k != "model.results_dir"},
                "without": list(self.without), "seed": self.seed}
        return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:12]


def flag_value(value: Any) -> str:
    """An override as a command-line value: strings as they are, everything else as JSON
    (which YAML reads: null, true, numbers, lists)."""
    return value if isinstance(value, str) else json.dumps(value)


def tiny_overrides(data_root: Path) -> dict[str, Any]:
    """`--tiny`: two steps on a tiny shapes set (64 px, random encoder), no validation (the
    test pass then uses the final weights), greedy decoding."""
    return {"data.source.root": str(data_root), "data.source.num_train": 24,
            "data.source.num_val": 8, "data.source.num_test": 8, "data.source.image_size": 64,
            "data.image_size": 64, "data.batch_size": 8, "data.eval_batch_size": 8,
            "model.net.weights": None, "model.warmup_steps": 0,
            "model.decode.strategy": "greedy", "model.decode.max_len": 8,
            "trainer.max_epochs": 1, "trainer.limit_train_batches": 2,
            "trainer.limit_val_batches": 0, "trainer.max_time": None}


def plan_cells(grid: Grid, *, seeds: Sequence[int], only: Sequence[str] | None, runs: Path,
               tiny: bool, imports: Sequence[str] = ()) -> list[Cell]:
    """Every selected variant × seed, in grid order; `imports`: the modules its cells import."""
    unknown = sorted(set(only or ()) - set(grid.variants))
    if unknown:
        raise ConfigError(f"--only {' '.join(unknown)}: not in grid {grid.name} "
                          f"({', '.join(grid.variants)})")
    cells = []
    for variant, over in grid.variants.items():
        if only and variant not in only:
            continue
        extra = over.get("configs") or []
        configs = tuple(config_file(str(c)) for c in [*grid.configs, *extra])
        if not configs or "trainer" not in (yaml.safe_load(configs[0].read_text()) or {}):
            raise ConfigError(f"grid {grid.name}: the first of base.configs must be a trainer "
                              "config (its output folders are moved into each cell's folder)")
        trainer_config_in(configs[0], runs, without=grid.without)  # a name that drops nothing
        for seed in seeds:
            run_dir = runs / variant / f"seed{seed}"
            flags = {**grid.overrides, **{k: v for k, v in over.items() if k != "configs"},
                     "seed_everything": seed,
                     **(tiny_overrides(runs / "tiny-data" / "shapes") if tiny else {}),
                     "model.results_dir": str(run_dir)}
            cells.append(Cell(variant, seed, run_dir, configs, flags, grid.without,
                              tuple(imports)))
    return cells


# -- the child: one cell in its own process ------------------------------------------------------

def alpha_entropy(alphas: Iterable[Any]) -> float:
    """Mean entropy (nats) of the attention weights over every step of every caption
    (`losses.mean_alpha_entropy`, as training logs it); NaN with no step at all."""
    import torch

    from captioning.losses import mean_alpha_entropy

    steps = [torch.as_tensor(a) for a in alphas]
    steps = [a for a in steps if a.numel()]
    if not steps:
        return math.nan  # every caption empty
    rows = torch.cat(steps)  # (steps, L)
    return float(mean_alpha_entropy(rows, torch.ones(len(rows))))


def run_cell(run_dir: Path) -> int:
    """Fit, test the best checkpoint, write `cell_result.json` (runs in the child process)."""
    from captioning.commands.lightning import lightning_cli

    spec = json.loads((run_dir / CELL_FILE).read_text())
    start = time.perf_counter()
    with contextlib.ExitStack() as claims:  # the cell's folder is its own until the result
        cli = lightning_cli(spec["args"], claims=claims)
        train_seconds = time.perf_counter() - start
        trainer, model = cli.trainer, cli.model
        val = dict(model.val_results.metrics)
        ckpt = trainer.checkpoint_callback
        best = ckpt.best_model_path if ckpt is not None and ckpt.best_model_path else None
        trainer.test(model, datamodule=cli.datamodule, ckpt_path=best, weights_only=True)
        results = model.test_results
        _write_result(run_dir, spec, results, val, train_seconds, best)
    return 0


def _write_result(run_dir: Path, spec: dict[str, Any], results: Any, val: dict[str, Any],
                  train_seconds: float, best: str | None) -> None:
    write_json_atomic(run_dir / RESULT_FILE, {
        "test": results.metrics, "val": val, "train_seconds": train_seconds,
        "alpha_entropy": None if math.isnan(entropy := alpha_entropy(results.alphas.values()))
        else entropy,  # JSON has no NaN: null, which the report reads as absent
        "checkpoint": best or "the final weights (no validation ran)",
        "config": spec["config"], "code": spec.get("code")}, indent=2)


# -- the parent: cells in child processes, results.csv --------------------------------------------

def stop_child(proc: subprocess.Popen[bytes], *, now: bool) -> None:
    """End a cell's process when the grid is interrupted. Ctrl-C in a terminal reaches the
    child too, which saves its checkpoint and exits: wait for that (`now` False) before
    terminating it; SIGTERM reaches the parent alone, which passes it on at once."""
    if not now:
        try:
            proc.wait(timeout=30)
            return
        except subprocess.TimeoutExpired:
            pass
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def write_cell_files(cell: Cell, config: str) -> None:
    """A fresh run folder holding the cell's trainer config and `cell.json` (its arguments and
    settings fingerprint `config`)."""
    if cell.run_dir.exists():  # an unfinished cell starts over: no stale versions, ckpts
        with claim_folder(cell.run_dir, what="cell folder"):  # not under a cell still running
            shutil.rmtree(cell.run_dir)
    cell.run_dir.mkdir(parents=True)
    trainer = trainer_config_in(cell.configs[0], cell.run_dir, without=cell.without)
    write_text_atomic(cell.run_dir / "trainer.yaml", yaml.safe_dump(trainer, sort_keys=False))
    write_json_atomic(cell.run_dir / CELL_FILE, {"variant": cell.variant, "seed": cell.seed,
                                                 "args": cell.fit_args(), "config": config,
                                                 "code": code_digest()}, indent=2)


def run_child(args: Sequence[str], log_path: Path) -> tuple[int, float]:
    """`captioning ARGS` in a child process, its console into `log_path`: (exit status,
    seconds). An interrupted child, or parent, interrupts the grid."""
    command = [sys.executable, "-m", "captioning.cli", *args]
    start = time.perf_counter()
    with open(log_path, "w") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=die_with_parent())  # no orphan if it dies
        try:
            returncode = proc.wait()
        except BaseException as e:
            stop_child(proc, now=not isinstance(e, KeyboardInterrupt))
            raise
    if returncode == 130:
        raise KeyboardInterrupt
    if returncode == 143:
        raise Terminated
    return returncode, time.perf_counter() - start


def train_cell(cell: Cell, metrics: Sequence[str]) -> dict[str, Any]:
    """Run one cell in a child process; its row for results.csv."""
    config = cell.fingerprint()  # of the settings it trains with, whatever changes meanwhile
    write_cell_files(cell, config)
    returncode, seconds = run_child(cell.command(["ablate", "--run-cell", str(cell.run_dir)]),
                                    cell.run_dir / LOG_FILE)
    row: dict[str, Any] = {"variant": cell.variant, "seed": cell.seed, "seconds": round(seconds, 1),
                           "config": config, "code": code_digest()}
    result_file = cell.run_dir / RESULT_FILE
    if returncode == 0 and result_file.is_file():
        row.update(status="ok", error="",
                   **cell_metrics(json.loads(result_file.read_text()), metrics))
    else:
        text = (cell.run_dir / LOG_FILE).read_text(errors="replace")
        row.update(status="failed", error=error_line(text, returncode))
    return row


def prepare_features(cell: Cell, runs: Path) -> None:
    """Build (or check) the frozen encoder's feature cache once, with `captioning
    cache-features` and the first cell's settings, so that no cell's training time includes
    it. Variants with another encoder build theirs in their first cell."""
    prep = replace(cell, run_dir=runs / "cache-features")
    write_cell_files(prep, prep.fingerprint())
    log.info("feature cache: checking or building it first (log: %s)", prep.run_dir / LOG_FILE)
    returncode, seconds = run_child(prep.command(["cache-features", *prep.fit_args()[1:]]),
                                    prep.run_dir / LOG_FILE)
    if returncode != 0:
        text = (prep.run_dir / LOG_FILE).read_text(errors="replace")
        log.warning("feature cache not prepared (%s); each cell builds what it needs",
                    error_line(text, returncode))
    else:
        log.info("feature cache ready in %.0f s", seconds)


def done_before(rows: dict[tuple[str, int], dict[str, Any]], cell: Cell, *,
                keep_done: bool = False) -> bool:
    """Whether this cell finished with its current settings and code (`keep_done`: whatever
    the code): an `ok` row in results.csv, or its own `cell_result.json` (whose row then goes
    back into `rows`)."""
    row, config = rows.get((cell.variant, cell.seed)), cell.fingerprint()
    if row and row.get("config") == config:  # a failed row is retried, whatever it left
        return row["status"] == "ok" and same_code(cell, row.get("code"), keep_done)
    result = cell.run_dir / RESULT_FILE
    try:
        found = json.loads(result.read_text()) if result.is_file() else {}
    except (OSError, ValueError):
        return False
    if found.get("config") != config or not same_code(cell, found.get("code"), keep_done):
        return False
    rows[(cell.variant, cell.seed)] = {
        "variant": cell.variant, "seed": cell.seed, "config": config, "status": "ok",
        "error": "", "seconds": round(found.get("train_seconds", math.nan), 1),
        "code": found.get("code")}
    return True


def same_code(cell: Cell, code: Any, keep_done: bool) -> bool:
    """Whether a result of `cell` trained by the package's source `code` (its `code_digest`)
    counts as done: the same code, or any with `keep_done`."""
    if code == code_digest():
        return True
    log.info("%s seed %d was done by other code (%s; now %s): %s", cell.variant, cell.seed,
             code or "not recorded", code_digest(),
             "kept (--keep-done)" if keep_done else "trains again (--keep-done keeps it)")
    return keep_done


def ordered(rows: dict[tuple[str, int], dict[str, Any]], grid: Grid) -> list[dict[str, Any]]:
    """Rows of the grid's variants, in grid order then by seed."""
    rank = {v: i for i, v in enumerate(grid.variants)}
    keep = [r for k, r in rows.items() if k[0] in rank]
    return sorted(keep, key=lambda r: (rank[r["variant"]], r["seed"]))


def run_grid(grid: Grid, cells: Sequence[Cell], out: Path, *, prepare: Path | None,
             keep_done: bool = False) -> list[dict[str, Any]]:
    """Train the cells not yet done (`done_before`), writing results.csv after each; returns
    every row. With `prepare` (the runs folder), the feature cache is built first."""
    csv_path = out / "results.csv"
    rows = {(r["variant"], r["seed"]): r for r in read_rows(csv_path)}
    todo = [c for c in cells if not done_before(rows, c, keep_done=keep_done)]
    if todo and prepare is not None:
        prepare_features(todo[0], prepare)
    for i, cell in enumerate(cells, 1):
        if cell not in todo:
            log.info("[%d/%d] %s seed %d: done before, kept", i, len(cells), cell.variant,
                     cell.seed)
            result = cell.run_dir / RESULT_FILE  # a metric added to the grid needs no training
            try:
                if result.is_file():
                    rows[(cell.variant, cell.seed)].update(
                        cell_metrics(json.loads(result.read_text()), grid.metrics))
            except (OSError, ValueError, TypeError, AttributeError) as e:  # damaged, or not
                log.warning("%s: cannot read (%s); its row keeps the figures of %s", result,
                            e, csv_path)
            continue
        log.info("[%d/%d] %s seed %d: training in %s", i, len(cells), cell.variant, cell.seed,
                 cell.run_dir)
        row = train_cell(cell, grid.metrics)
        rows[(cell.variant, cell.seed)] = row
        write_rows(csv_path, ordered(rows, grid), grid.metrics)
        log.info("[%d/%d] %s seed %d: %s in %.0f s%s", i, len(cells), cell.variant, cell.seed,
                 row["status"], row["seconds"], f" ({row['error']})" if row["error"] else "")
    return ordered(rows, grid)


def warn_unreported(rows: Sequence[dict[str, Any]], cells: Sequence[Cell],
                    metrics: Sequence[str]) -> None:
    """Warn of the grid's metrics that no finished cell reports (a misspelt name: a column of
    dashes), with the names a cell's result file has."""
    missing = unreported_metrics(rows, metrics)
    result = next((c.run_dir / RESULT_FILE for c in cells if (c.run_dir / RESULT_FILE).is_file()),
                  None)
    if not missing or result is None:
        return
    try:
        found = json.loads(result.read_text())
    except (OSError, ValueError):  # a damaged result file: the table is still written
        found = {}
    names = [*found.get("test", {}), *(f"val/{k}" for k in found.get("val", {})), *CELL_METRICS]
    log.warning("metrics %s: no cell reports them; a cell reports %s", ", ".join(missing),
                ", ".join(names))


def dry_run(cells: Sequence[Cell], out: Path, *, keep_done: bool = False) -> None:
    """Print every cell, whether it is done, and the command it runs."""
    rows = {(r["variant"], r["seed"]): r for r in read_rows(out / "results.csv")}
    for cell in cells:
        state = "done" if done_before(rows, cell, keep_done=keep_done) else "to run"
        sys.stdout.write(f"{cell.variant} seed {cell.seed} ({state}): {cell.run_dir}\n"
                         f"  captioning {shlex.join(cell.command(cell.fit_args()))}\n"
                         "  then test with the best checkpoint\n")
    sys.stdout.write(f"{len(cells)} cells; results in {out}\n")
    sys.stdout.flush()


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="captioning ablate",
        description="Train and test every variant × seed of an ablation grid; write "
                    "results.csv, table.md (mean ± sd over seeds) and plot.png. Re-running "
                    "continues an interrupted grid. Exit status 1 when a cell failed.")
    p.add_argument("--grid", default="attention", help="a grid under configs/ablations/, or a "
                   "YAML file (default: attention)")
    p.add_argument("--out", default=None, help="results folder (default: the --runs folder; "
                   "the README's table: --out docs/ablations/attention)")
    p.add_argument("--runs", default=None, help="run folders (default: runs/ablations/<grid>)")
    p.add_argument("--seeds", default=None, help="comma-separated seeds (default: the grid's)")
    p.add_argument("--only", nargs="+", default=None, metavar="VARIANT",
                   help="train only these variants (the table keeps the others' rows)")
    p.add_argument("--dry-run", action="store_true", help="print the cells and their commands")
    p.add_argument("--keep-done", action="store_true",
                   help="keep cells done by other code (the package's source changed since)")
    p.add_argument("--tiny", action="store_true",
                   help="shrink every cell to a few steps on a tiny dataset (tests)")
    p.add_argument("--run-cell", default=None, help=argparse.SUPPRESS)  # the child process
    p.add_argument("--import", dest="imports", action="append", default=[],
                   help=argparse.SUPPRESS)  # `captioning --import M ablate`: for the cells
    return p.parse_args(argv)


def seeds_of(text: str | None, grid: Grid) -> tuple[int, ...]:
    if text is None:
        return grid.seeds
    try:
        return tuple(int(s) for s in text.split(",") if s.strip())
    except ValueError:
        raise ConfigError(f"--seeds {text}: expected comma-separated integers") from None


def main(argv: Sequence[str] | None = None) -> int:
    a = parse_args(argv)
    if a.run_cell:
        return run_cell(Path(a.run_cell))
    grid = load_grid(find_grid(a.grid))
    runs = Path(a.runs or f"runs/ablations/{grid.name}")
    out = Path(a.out) if a.out else runs  # results.csv, table.md, plot.png beside the cells
    cells = plan_cells(grid, seeds=seeds_of(a.seeds, grid), only=a.only, runs=runs, tiny=a.tiny,
                       imports=a.imports)
    if a.dry_run:
        dry_run(cells, out, keep_done=a.keep_done)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(out / "results.csv", what=f"grid {out}"), sigterm_raises():
        rows = run_grid(grid, cells, out, prepare=None if a.tiny else runs,
                        keep_done=a.keep_done)
        warn_unreported(rows, cells, grid.metrics)
        write_table(out / "table.md", grid.name, rows, list(grid.variants), grid.metrics)
        write_plot(out / "plot.png", grid.name, rows, list(grid.variants), grid.metrics)
    log.info("wrote %s, %s and %s", out / "results.csv", out / "table.md", out / "plot.png")
    keys = {(c.variant, c.seed) for c in cells}
    return 1 if any(r["status"] != "ok" and (r["variant"], r["seed"]) in keys for r in rows) else 0
