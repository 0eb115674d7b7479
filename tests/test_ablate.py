"""`captioning ablate`: a tiny grid end to end (a failing variant, resume), the dry run, the
shipped grid, and the table and plot from known rows."""

from __future__ import annotations

import csv
import math
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import needs_java
from PIL import Image

from captioning.cli import main
from captioning.commands.ablate import alpha_entropy, plan_cells
from captioning.commands.ablation_grid import GRID_DIR, find_grid, load_grid
from captioning.commands.ablation_report import (
    error_line,
    summarise,
    table_markdown,
    write_plot,
)

TINY_GRID = {
    "base": {"configs": ["trainer/cpu", "data/shapes"],
             "overrides": {"trainer.enable_progress_bar": False},
             "without": ["WandbLogger", "AttentionOverlayCallback"]},
    "seeds": [0, 1],
    "metrics": ["BLEU-4", "pointing_accuracy", "train_seconds", "alpha_entropy"],
    "variants": {"soft/additive": {"configs": ["model/demo_soft"]},
                 "soft/dot": {"configs": ["model/demo_soft"], "model.net.score": "dot"},
                 "bad": {"configs": ["model/demo_soft"], "model.net.score": "bogus"}},
}


@pytest.fixture
def tiny_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # tiny cells: one thread is faster on 2 cores
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(TINY_GRID, sort_keys=False))
    return path


def read_csv(path: Path) -> list[dict[str, str]]:
    return list(csv.DictReader(path.open()))


@needs_java
def test_tiny_grid_end_to_end_with_a_failing_variant_and_resume(tiny_grid: Path) -> None:
    """First an "interrupted" grid (one variant), then the whole grid: the finished cells are
    kept, the others train, the bad variant fails with its error and does not stop the grid."""
    args = ["ablate", "--grid", str(tiny_grid), "--tiny", "--out", "out", "--runs", "runs"]
    assert main([*args, "--only", "soft/additive"]) == 0
    first = {s: Path(f"runs/soft/additive/seed{s}/cell_result.json").stat().st_mtime_ns
             for s in (0, 1)}
    assert [(r["variant"], r["status"]) for r in read_csv(Path("out/results.csv"))] == \
        [("soft/additive", "ok")] * 2

    assert main(args) == 1  # a cell failed
    for seed, mtime in first.items():  # not retrained
        assert Path(f"runs/soft/additive/seed{seed}/cell_result.json").stat().st_mtime_ns == mtime
    rows = read_csv(Path("out/results.csv"))
    assert [(r["variant"], r["seed"], r["status"]) for r in rows] == [
        ("soft/additive", "0", "ok"), ("soft/additive", "1", "ok"), ("soft/dot", "0", "ok"),
        ("soft/dot", "1", "ok"), ("bad", "0", "failed"), ("bad", "1", "failed")]
    assert list(rows[0]) == ["variant", "seed", "status", "error", "BLEU-4", "pointing_accuracy",
                             "train_seconds", "alpha_entropy", "seconds", "config", "code"]
    for r in rows[:4]:
        assert r["error"] == "" and 0 <= float(r["BLEU-4"]) <= 1
        assert 0 < float(r["alpha_entropy"]) <= math.log(16) + 1e-6  # a 4x4 grid at 64 px
        assert 0 < float(r["train_seconds"]) < float(r["seconds"])
    for r in rows[4:]:
        assert r["error"].startswith("net.score must be one of") and "'bogus'" in r["error"]
        assert r["BLEU-4"] == ""

    table = Path("out/table.md").read_text()
    entropies = [float(r["alpha_entropy"]) for r in rows[2:4]]
    expected = f"{statistics.fmean(entropies):.3f} ± {statistics.stdev(entropies):.3f}"
    dot_line = next(ln for ln in table.splitlines() if ln.startswith("| soft/dot |"))
    assert "| 2/2 |" in dot_line and expected in dot_line
    assert next(ln for ln in table.splitlines() if ln.startswith("| bad |")).count("–") == 4
    assert "Failed cells: 2." in table and "- bad seed 1: net.score must be one of" in table
    with Image.open("out/plot.png") as img:
        assert img.format == "PNG" and img.width > 300 and img.height > 100
    test_metrics = Path("runs/soft/dot/seed0/test_metrics.json")
    assert test_metrics.is_file()  # each cell's own run folder

    # Another --out (or a lost results.csv): the cells' own results say they are done.
    finished = {p: p.stat().st_mtime_ns for p in Path("runs").glob("soft/*/seed*/cell_result.json")}
    assert len(finished) == 4
    assert main([*args[:-4], "--out", "elsewhere", "--runs", "runs"]) == 1  # bad fails again
    assert {p: p.stat().st_mtime_ns for p in finished} == finished  # nothing retrained
    again = read_csv(Path("elsewhere/results.csv"))
    assert [(r["variant"], r["status"]) for r in again] == [(r["variant"], r["status"])
                                                            for r in rows]
    assert [r["BLEU-4"] for r in again[:4]] == [r["BLEU-4"] for r in rows[:4]]


def test_the_feature_cache_step_and_a_failed_cell_that_left_a_result(
        tiny_grid: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without --tiny the grid first runs `cache-features` in its own folder; a cell whose
    child wrote its result and then failed is retried, not taken as done (children faked)."""
    import json

    from captioning.commands import ablate

    calls: list[str] = []
    fail = {"now": True}

    def child(args: list[str], log_path: Path) -> tuple[int, float]:
        calls.append(args[0])
        log_path.write_text("error: the cell broke after writing its result\n")
        if args[0] == "ablate":
            run_dir = Path(args[-1])
            spec = json.loads((run_dir / ablate.CELL_FILE).read_text())
            (run_dir / ablate.RESULT_FILE).write_text(json.dumps(
                {"test": {"BLEU-4": 0.5}, "val": {}, "config": spec["config"]}))
            return (1 if fail["now"] else 0), 1.0
        return 0, 0.5

    monkeypatch.setattr(ablate, "run_child", child)
    grid = load_grid(tiny_grid)
    cells = plan_cells(grid, seeds=[0], only=["soft/dot"], runs=Path("runs"), tiny=False)
    Path("out").mkdir()
    rows = ablate.run_grid(grid, cells, Path("out"), prepare=Path("runs"))
    assert calls == ["cache-features", "ablate"] and rows[0]["status"] == "failed"
    assert (Path("runs") / "cache-features" / "trainer.yaml").is_file()
    fail["now"] = False
    rows = ablate.run_grid(grid, cells, Path("out"), prepare=Path("runs"))
    assert calls[2:] == ["cache-features", "ablate"] and rows[0]["status"] == "ok"
    ablate.run_grid(grid, cells, Path("out"), prepare=Path("runs"))
    assert len(calls) == 4  # done now: nothing runs


def test_a_cell_done_by_other_code_trains_again_unless_kept(
        tiny_grid: Path, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A result records the digest of the package's source that trained it: after an edit to
    the package (a scorer's code), the cell trains again, from results.csv or from its own
    result file; `--keep-done` keeps it (children faked)."""
    import json
    import logging

    from captioning.commands import ablate

    calls: list[str] = []

    def child(args: list[str], log_path: Path) -> tuple[int, float]:
        spec = json.loads((Path(args[-1]) / ablate.CELL_FILE).read_text())
        calls.append(spec["code"])
        (Path(args[-1]) / ablate.RESULT_FILE).write_text(json.dumps(
            {"test": {"BLEU-4": 0.5}, "val": {}, "config": spec["config"], "code": spec["code"]}))
        return 0, 1.0

    monkeypatch.setattr(ablate, "run_child", child)
    grid = load_grid(tiny_grid)
    cells = plan_cells(grid, seeds=[0], only=["soft/dot"], runs=Path("runs"), tiny=False)
    Path("out").mkdir()

    def run(code: str, keep_done: bool = False) -> list[dict[str, Any]]:
        monkeypatch.setattr(ablate, "code_digest", lambda: code * 12)
        caplog.clear()
        with caplog.at_level(logging.INFO):
            return ablate.run_grid(grid, cells, Path("out"), prepare=None, keep_done=keep_done)

    run("a")
    run("a")
    assert calls == ["a" * 12]  # the same code: done
    result = cells[0].run_dir / ablate.RESULT_FILE
    good = result.read_text()
    for damaged in ("{damaged", "[]", '{"test": 1}'):  # not JSON, or not a cell's result
        result.write_text(damaged)
        assert run("a")[0]["BLEU-4"] == 0.5  # results.csv's figure stands; nothing trains
        assert calls == ["a" * 12] and any("cannot read" in m for m in caplog.messages)
    result.write_text(good)
    run("b", keep_done=True)
    assert calls == ["a" * 12]
    assert ("soft/dot seed 0 was done by other code (aaaaaaaaaaaa; now bbbbbbbbbbbb): kept "
            "(--keep-done)") in caplog.messages
    rows = run("b")
    assert calls == ["a" * 12, "b" * 12]
    assert ("soft/dot seed 0 was done by other code (aaaaaaaaaaaa; now bbbbbbbbbbbb): trains "
            "again (--keep-done keeps it)") in caplog.messages
    assert rows[0]["code"] == "b" * 12 and rows[0]["status"] == "ok"
    assert read_csv(Path("out/results.csv"))[0]["code"] == "b" * 12
    Path("out/results.csv").unlink()  # its own result file says which code trained it
    run("c")
    assert calls == ["a" * 12, "b" * 12, "c" * 12]


def test_grid_names_that_name_nothing_are_reported(tiny_grid: Path,
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """A `without` entry that drops no logger or callback stops the grid before any cell; a
    metric that no finished cell reports is warned of, with the names a cell reports."""
    import json
    import logging

    from captioning.commands import ablate
    from captioning.commands.ablation_report import unreported_metrics
    from captioning.commands.errors import ConfigError

    grid = load_grid(tiny_grid)
    typo = replace(grid, without=("WandbLoger", "AttentionOverlayCallback"))
    with pytest.raises(ConfigError, match=r"cpu\.yaml: without WandbLoger: no logger or callback "
                                          r"of this trainer config has that class name \(it "
                                          r"has: .*WandbLogger"):
        plan_cells(typo, seeds=[0], only=None, runs=Path("runs"), tiny=True)
    full = replace(grid, without=("lightning.pytorch.loggers.CSVLogger",))  # or its path
    assert plan_cells(full, seeds=[0], only=None, runs=Path("runs"), tiny=True)
    one = Path("one.yaml")  # a logger given as one mapping, not a list (Lightning takes both)
    one.write_text(yaml.safe_dump({"trainer": {"logger": {
        "class_path": "lightning.pytorch.loggers.CSVLogger", "init_args": {"save_dir": "."}}}}))
    from captioning.commands.configs import trainer_config_in

    assert trainer_config_in(one, Path("cell"), without=["CSVLogger"])["trainer"]["logger"] == []

    rows = [{"status": "ok", "BLEU4": math.nan, "BLEU-4": 0.5},
            {"status": "failed", "BLEU4": 1.0, "BLEU-4": math.nan}]
    assert unreported_metrics(rows, ["BLEU-4", "BLEU4"]) == ["BLEU4"]
    (cell,) = plan_cells(grid, seeds=[0], only=["soft/dot"], runs=Path("runs"), tiny=True)
    cell.run_dir.mkdir(parents=True)
    (cell.run_dir / ablate.RESULT_FILE).write_text(json.dumps(
        {"test": {"BLEU-4": 0.5, "CIDEr": 1.0}, "val": {"BLEU-4": 0.4}}))
    with caplog.at_level(logging.WARNING):
        ablate.warn_unreported(rows, [cell], ["BLEU-4", "BLEU4"])
    assert caplog.messages == ["metrics BLEU4: no cell reports them; a cell reports BLEU-4, "
                               "CIDEr, val/BLEU-4, train_seconds, alpha_entropy"]


def test_dry_run_lists_every_cell(tiny_grid: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["ablate", "--grid", str(tiny_grid), "--dry-run", "--seeds", "0,1,2",
                 "--out", "out"]) == 0
    out = capsys.readouterr().out
    for variant in TINY_GRID["variants"]:
        for seed in (0, 1, 2):
            assert f"{variant} seed {seed} (to run): runs/ablations/tiny/{variant}/seed{seed}" in out
    assert out.count("captioning fit --config") == 9 and "9 cells" in out
    assert "--model.net.score dot" in out and "--seed_everything 2" in out
    assert not Path("runs").exists() and not Path("out").exists()  # nothing trained or written
    # `captioning --import M ablate`: each cell's child process imports M too
    for imports in (["--import", "json"], ["--import=json"]):
        assert main([*imports, "ablate", "--grid", str(tiny_grid), "--dry-run",
                     "--only", "soft/dot", "--seeds", "0"]) == 0
        assert "  captioning --import json fit --config" in capsys.readouterr().out
    assert main(["--import=", "ablate"]) == 2
    assert "error: --import: expected a module name" in capsys.readouterr().err


def test_the_shipped_attention_grid(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                    capsys: pytest.CaptureFixture[str]) -> None:
    """The issue's rows, three seeds, one budget, every config found; the README's commands
    (dry runs)."""
    monkeypatch.chdir(tmp_path)
    assert main(["ablate", "--grid", "attention", "--dry-run"]) == 0
    assert "30 cells; results in runs/ablations/attention\n" in capsys.readouterr().out
    assert main(["ablate", "--out", "docs/ablations/attention", "--dry-run"]) == 0
    assert "30 cells; results in docs/ablations/attention\n" in capsys.readouterr().out
    assert main(["ablate", "--only", "soft/dot", "--seeds", "0,1", "--dry-run"]) == 0
    assert "2 cells" in capsys.readouterr().out
    assert main(["ablate", "--only", "soft/nope", "--dry-run"]) == 2
    assert "error: --only soft/nope: not in grid attention" in capsys.readouterr().err
    grid = load_grid(find_grid("attention"))
    assert find_grid("attention") == GRID_DIR / "attention.yaml"
    assert grid.seeds == (0, 1, 2)
    assert {"soft/additive", "soft/dot", "soft/general", "soft/scaled_dot", "soft/sparsemax",
            "hard/reinforce/sequence/paper", "hard/reinforce/sequence/detached",
            "hard/reinforce/expected"} <= set(grid.variants)
    assert any(v.startswith("hard/gumbel/tau") for v in grid.variants)
    cells = plan_cells(grid, seeds=grid.seeds, only=None, runs=Path("r"), tiny=False)
    assert len(cells) == 3 * len(grid.variants)
    budgets = {tuple(sorted((k, v) for k, v in c.overrides.items() if k.startswith("trainer.")))
               for c in cells}
    assert len(budgets) == 1  # one training budget for every row
    by_name = {c.variant: c for c in cells}
    assert by_name["hard/reinforce/sequence/detached"].overrides[
        "model.net.semi_sampling_grad"] == "detached"
    assert by_name["soft/scaled_dot"].configs[-1].name == "demo_soft.yaml"
    assert GRID_DIR.parent.name == "configs"  # configs/*/*.yaml: package data (pyproject.toml)


def _row(variant: str, seed: int, status: str = "ok", **metrics: float) -> dict[str, Any]:
    return {"variant": variant, "seed": seed, "status": status,
            "error": "" if status == "ok" else "boom", **metrics}


def test_table_and_plot_from_known_rows(tmp_path: Path) -> None:
    rows = [_row("a", 0, m=0.5, s=100.0), _row("a", 1, m=0.7, s=120.0),
            _row("a", 2, "failed", m=math.nan, s=math.nan), _row("b", 0, m=0.25, s=10.0)]
    a, b = summarise(rows, ["a", "b", "c"], ["m", "s"])
    assert (a.ok, a.total, a.failed) == (2, 3, [(2, "boom")])
    assert a.mean["m"] == pytest.approx(0.6) and a.sd["m"] == pytest.approx(0.1414, abs=1e-4)
    assert b.ok == 1 and math.isnan(b.sd["m"])
    table = table_markdown("g", rows, ["a", "b"], ["m", "train_seconds"])
    assert "| variant | ok | test m | training time (s) |" in table
    assert "| a | 2/3 | 0.600 ± 0.141 |" in table and "| b | 1/1 | 0.250 |" in table
    assert "Failed cells: 1.\n- a seed 2: boom" in table
    path = write_plot(tmp_path / "plot.png", "g", rows, ["a", "b"], ["m", "s"])
    with Image.open(path) as img:
        assert img.size[0] > 400 and img.mode == "RGB"


def test_error_line() -> None:
    log = "INFO: x\nTraceback (most recent call last):\n  File ...\nValueError: bad thing\n"
    assert error_line(log, 1) == "ValueError: bad thing"
    assert error_line("INFO: x\nerror: --a: invalid value 'b'\n", 2) == "--a: invalid value 'b'"
    assert error_line("", 3) == "exit status 3"
    # a killed cell: the signal, not the last progress-bar line of its log
    assert error_line("caching val features: 100%|#####| 8/8\n", -9) == "killed by SIGKILL"


def test_alpha_entropy_is_the_mean_over_steps() -> None:
    import torch

    uniform, peaked = torch.full((2, 4), 0.25), torch.tensor([[1.0, 0.0, 0.0, 0.0]])
    assert alpha_entropy([uniform, peaked]) == pytest.approx(2 * math.log(4) / 3)
    assert math.isnan(alpha_entropy([]))


@pytest.mark.parametrize(("text", "words"), [
    ("base: [a]\nvariants: {x: {}}\n", "a grid is a mapping with `variants`"),
    ("- just a list\n", "a grid is a mapping with `variants`"),
    ("variants: {x: {a: 1}\n", "not valid YAML (line 2)"),
    ("variants: {}\n", "`variants` must map each variant's name"),
])
def test_a_malformed_grid_file_is_one_line_naming_it(tmp_path: Path, text: str,
                                                     words: str) -> None:
    from captioning.commands.errors import ConfigError

    path = tmp_path / "grid.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_grid(path)
    assert str(info.value).startswith(f"{path}: ") and words in str(info.value)
    assert "\n" not in str(info.value)


def test_a_cell_still_running_keeps_its_folder_and_dies_with_its_parent(
        tiny_grid: Path) -> None:
    """A re-run after the parent was killed: the orphaned cell's folder is not removed under it
    (its run holds the folder), and a cell's process gets SIGTERM when its parent dies, even by
    SIGKILL, so that no orphan is left to hold it."""
    import subprocess
    import sys
    import time

    from captioning.commands import ablate
    from captioning.locks import FolderInUseError, claim_folder

    grid = load_grid(tiny_grid)
    (cell,) = plan_cells(grid, seeds=[0], only=["soft/dot"], runs=Path("runs"), tiny=True)
    cell.run_dir.mkdir(parents=True)
    (cell.run_dir / "last.ckpt").write_bytes(b"a running cell's")
    with claim_folder(cell.run_dir), pytest.raises(FolderInUseError, match="cell folder in use"):
        ablate.write_cell_files(cell, "fingerprint")
    assert (cell.run_dir / "last.ckpt").read_bytes() == b"a running cell's"
    ablate.write_cell_files(cell, "fingerprint")  # once free: a fresh folder
    assert not (cell.run_dir / "last.ckpt").exists()

    parent = subprocess.Popen([sys.executable, "-c", (
        "import subprocess, sys, time\n"
        "from captioning.locks import die_with_parent\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'],"
        " preexec_fn=die_with_parent())\n"
        "print(p.pid, flush=True)\n"
        "time.sleep(60)\n")], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    status = Path(f"/proc/{child}/status")
    for _ in range(100):  # gone, or a zombie waiting for its new parent to reap it
        if not status.exists() or "State:\tZ" in status.read_text():
            break
        time.sleep(0.05)
    else:
        subprocess.run(["kill", "-9", str(child)], check=False)
        pytest.fail("the child outlived its killed parent")
