"""`make gpu-check` in its CPU-fallback mode: every stage runs at tiny sizes on the CPU and the
one table has a row for each (the figures mean nothing there; a CUDA machine gives the real
ones)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from tiny_runs import REPO

STAGES = ("gpu tests", "train", "train COCO-size", "profile", "train uncached", "beam search",
          "overlays", "ddp")


def test_make_gpu_check_runs_the_script() -> None:
    out = subprocess.run(["make", "-n", "gpu-check"], cwd=REPO, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert "scripts/gpu_check.py" in out.stdout


def test_cpu_fallback_prints_every_stage(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu", "--workdir", str(tmp_path / "work"),
         "--json", str(tmp_path / "check.json"), "--rounds", "2"],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-4000:]
    table = [ln for ln in out.stdout.splitlines() if ln.startswith("| ")]
    assert table[0].split("|")[1].strip() == "stage"
    for stage in STAGES:
        assert any(ln.split("|")[1].strip() == stage for ln in table), stage
    rows = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert all(r["result"] != "FAILED" for r in rows)
    by_stage: dict[str, list[dict]] = {}
    for r in rows:
        by_stage.setdefault(r["stage"], []).append(r)
    # Eager at bf16-mixed and fp32, two batch sizes; then the fast path (compile on the CPU),
    # and the fast path with the grids held on the device.
    assert len(by_stage["train"]) == 6
    fast, ondevice = by_stage["train"][-2:]
    assert fast["config"].endswith("fast_path compile") and "x eager" in fast["notes"]
    assert ondevice["config"].endswith("fast_path compile, grids on the device")
    assert "x the loader's grids" in ondevice["notes"] and "x eager" in ondevice["notes"]
    (eager,) = [r for r in by_stage["train"] if r["config"] == "cached, 32-true, batch 4"]
    for row in (eager, fast, ondevice):  # the headline rows on the CPU: two rounds, pooled
        assert "2 rounds (means " in row["notes"], row
    seconds = json.loads((tmp_path / "check.json").read_text())["seconds"]
    assert {"train", "beam", "coco", "profile", "overlay"} <= seconds.keys()
    assert "seconds per stage: " in out.stdout
    beams = by_stage["beam search"]
    assert len(beams) == 8  # beam 3 and 5, two batch sizes, fast_beam off and graphs
    assert sum("fast_beam graphs" in str(row) and "x off's" in str(row) for row in beams) == 4
    # each image's best caption compared with off's (the same here: one machine, one kernel)
    assert sum("20/20 best captions as off's" in row["notes"] for row in beams) == 4
    assert by_stage["gpu tests"][0]["result"].endswith(" 0 failed")
    assert "of 256 grids" in by_stage["train COCO-size"][0]["notes"]  # says how many
    assert "WARNING" not in by_stage["train COCO-size"][0]["notes"]  # the synthetic cache hit
    coco_on_device = by_stage["train COCO-size"][1]  # the same cache, on the device
    assert coco_on_device["config"].endswith(", grids on the device")
    assert "x the loader's" in coco_on_device["notes"]
    # The headline setting profiled, eager and the fast path (no GPU busy time on the CPU)
    assert [r["config"] for r in by_stage["profile"]] == [
        "cached, 32-true, batch 4, fast_path off, profiled",
        "cached, 32-true, batch 4, fast_path compile, profiled",
        "cached, 32-true, batch 4, fast_path compile, Python profiled"]
    for r in by_stage["profile"][:2]:
        assert r["result"].endswith(" ms a step"), r
        assert "top host ops, self ms a step: " in r["notes"], r
    python = by_stage["profile"][2]  # the fast path's host time by file, all in the JSON
    files = python["python_by_file"]
    assert f" ms in the top {len(files)} files of " in python["result"], python
    assert "Python self ms a step by file: " in python["notes"], python
    assert 6 <= len(files) <= 12 and 0 < sum(f["share"] for f in files) <= 1 + 1e-9
    assert all(f["self_ms"] >= 0 for f in files)
    assert [f["self_ms"] for f in files] == sorted((f["self_ms"] for f in files), reverse=True)
    assert by_stage["ddp"][0]["config"].startswith("2 processes")
    assert "scaling efficiency" in by_stage["ddp"][0]["notes"]
    for r in rows:
        if r["stage"] != "gpu tests":
            assert float(r["result"].split()[0]) > 0, r


def test_the_gpu_tests_are_collected_from_their_own_modules_only() -> None:
    """A bare GPU machine may lack what other test modules import (pycocoevalcap): pytest
    -m gpu collects only the modules that hold GPU tests."""
    import gpu_check

    names = {Path(f).name for f in gpu_check.gpu_test_files()}
    assert {"test_gpu.py", "test_viz.py"} <= names  # a module mark, a test's mark
    assert not names & {"test_cider.py", "test_gpu_check.py"}


def _check(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], list[dict]]:
    out = subprocess.run(
        [sys.executable, "scripts/gpu_check.py", "--cpu", "--workdir", str(tmp_path / "work"),
         "--json", str(tmp_path / "check.json"), *args],
        cwd=REPO, capture_output=True, text=True, timeout=900)
    return out, json.loads((tmp_path / "check.json").read_text())["rows"]


def test_past_its_deadline_the_check_starts_nothing_and_lists_what_it_skipped(
        tmp_path: Path) -> None:
    out, rows = _check(tmp_path, "--stages", "beam,train", "--deadline-s", "0")
    assert out.returncode == 0, out.stderr[-4000:]
    assert [(r["stage"], r["result"], r["notes"]) for r in rows] == [  # in the order asked for
        ("beam", "skipped", "past --deadline-s"), ("train", "skipped", "past --deadline-s")]
    assert "| train " in out.stdout and "skipped" in out.stdout  # the table still prints


def test_headline_only_trains_the_headline_rows(tmp_path: Path) -> None:
    out, rows = _check(tmp_path, "--stages", "train", "--headline-only", "--rounds", "1")
    assert out.returncode == 0, out.stderr[-4000:]
    assert [r["config"] for r in rows] == [
        "cached, 32-true, batch 4", "cached, 32-true, batch 4, fast_path compile",
        "cached, 32-true, batch 4, fast_path compile, grids on the device"]
    assert all(float(r["result"].split()[0]) > 0 for r in rows)


def test_a_worker_past_its_time_is_killed_with_its_children() -> None:
    from bench.process import finish_worker, own_process_group

    child = "import subprocess, time; subprocess.Popen(['sleep', '60']); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", child], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, **own_process_group())
    with pytest.raises(RuntimeError, match="ran past 1 s; killed"):
        finish_worker(proc, "train", timeout=1.0)
    assert proc.poll() is not None  # and its `sleep` went with its group: communicate returned


def test_gpu_tests_past_the_deadline_are_killed_and_say_so(tmp_path: Path) -> None:
    import gpu_check
    from bench.process import own_process_group

    check = gpu_check.Check(cpu=False, work=tmp_path, base={}, threads=None, coco_images=0,
                            json_path=tmp_path / "check.json")
    slow = ("import subprocess, sys, time; print('..s.'); sys.stdout.flush(); "
            "subprocess.Popen(['sleep', '60']); time.sleep(60)")  # the child keeps the pipe
    proc = subprocess.Popen([sys.executable, "-c", slow], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, **own_process_group())
    gpu_check.finish_gpu_tests(check, proc, timeout=1.0)
    (row,) = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert (row["result"], row["notes"]) == (
        "killed at --deadline-s", "about 3 passed before; the output's tail is in the log")
    assert not check.failed and proc.poll() is not None


def test_the_gpu_tests_row_names_the_slowest_tests(tmp_path: Path) -> None:
    """The row reads pytest's own `--durations` lines, as the check asks for them."""
    import gpu_check
    from bench.process import own_process_group

    (tmp_path / "test_slow.py").write_text(  # the slowest by setup and call added up
        "import time\n\nimport pytest\n\npytestmark = pytest.mark.gpu\n\n\n"
        "@pytest.fixture\ndef slow_setup():\n    time.sleep(1.2)\n\n\n"
        "def test_slow(slow_setup):\n    time.sleep(1.2)\n\n\n"
        "def test_slower():\n    time.sleep(1.6)\n\n\n"
        "def test_slowish():\n    time.sleep(1.1)\n\n\n"
        "def test_slowest():\n    time.sleep(1.4)\n\n\ndef test_quick():\n    pass\n")
    check = gpu_check.Check(cpu=False, work=tmp_path, base={}, threads=None, coco_images=0,
                            json_path=tmp_path / "check.json")
    proc = subprocess.Popen(gpu_check.gpu_test_command([str(tmp_path / "test_slow.py")]),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, **own_process_group())
    gpu_check.finish_gpu_tests(check, proc)
    (row,) = json.loads((tmp_path / "check.json").read_text())["rows"]
    assert row["result"] == "5 passed, 0 failed"
    assert gpu_check.SLOWEST_TESTS == 3
    assert re.fullmatch(r"0 skipped; slowest: test_slow [23] s, test_slower [23] s, "
                        r"test_slowest [12] s", row["notes"]), row["notes"]


def test_the_wheels_script_parses_and_pins_installed_packages() -> None:
    """scripts/gpu_wheels.sh (the wheels a bare CUDA image lacks, docs/benchmarks.md): bash
    reads it, and each package it pins is installed here, where its version is read."""
    import importlib.metadata
    import re

    script = REPO / "scripts" / "gpu_wheels.sh"
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    names = re.search(r"^PACKAGES=\(([^)]*)\)", script.read_text(), re.M).group(1).split()
    assert "jsonargparse" in names
    for name in names:
        assert importlib.metadata.version(name)


def test_a_failed_beam_setting_is_its_own_failed_row(tmp_path: Path) -> None:
    """The beam worker reports a setting that raised (a graph's capture, say) as that row's
    error and goes on; the stage keeps the other rows, off's first, and fails the check."""
    import gpu_check

    check = gpu_check.Check(cpu=True, work=tmp_path, base={}, threads=None, coco_images=0)
    asked: list[list[Any]] = []

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        asked.extend(spec["settings"])
        return {"rows": [{"error": "RuntimeError: capture failed"} if fast == "graphs" and
                         beam == 5 else {"captions_per_s": 10.0 * (1 + (fast != "off")),
                                         "step_ms": 1.0, "peak_mb": 0.0, "notes": "n"}
                         for beam, _, fast in spec["settings"]]}

    check.run = run  # type: ignore[method-assign]
    gpu_check.stage_beam(check)
    assert [fast for _, _, fast in asked] == ["off"] * 4 + ["graphs"] * 4
    results = [(r["config"], r["result"]) for r in check.rows]
    assert results[-2:] == [("beam 5, 5 images per batch, fast_beam graphs", "FAILED"),
                            ("beam 5, 10 images per batch, fast_beam graphs", "FAILED")]
    assert check.rows[4]["notes"] == "n; 2.00x off's" and check.failed


@pytest.mark.parametrize("killed", [True, False])
def test_a_beam_worker_that_stops_leaves_the_rows_it_finished(tmp_path: Path,
                                                              killed: bool) -> None:
    """The worker appends each row as it is measured. Killed at the deadline, or dead (a CUDA
    error, the OOM killer), its finished rows (not a line cut short) are the stage's, and one
    row says what was not run: skipped past the deadline, FAILED otherwise."""
    import gpu_check

    check = gpu_check.Check(cpu=True, work=tmp_path, base={}, threads=None, coco_images=0)
    (tmp_path / "beam_rows.jsonl").write_text("left by an earlier run\n")

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        row = {"captions_per_s": 10.0, "step_ms": 1.0, "peak_mb": 0.0, "notes": "n"}
        with open(spec["rows_file"], "a") as f:
            f.write("".join(json.dumps(row) + "\n" for _ in range(3)) + '{"captions_per')
        if killed:
            raise gpu_check.PastDeadline("killed at --deadline-s")
        raise RuntimeError("benchmark worker beam failed (exit -9)")

    check.run = run  # type: ignore[method-assign]
    gpu_check.stage_beam(check)
    rest = ("killed at --deadline-s", "past --deadline-s") if killed else (
        "FAILED", "RuntimeError: benchmark worker beam failed (exit -9)")
    assert [(r["config"], r["result"], r["notes"]) for r in check.rows] == [
        *((f"beam {b}, {n} images per batch, fast_beam off", "10.0 captions/s", "n")
          for b, n in ((3, 5), (3, 10), (5, 5))),
        ("the other 5 settings", *rest)]
    assert check.failed is not killed


def test_a_beam_worker_that_dies_after_its_last_row_fails_the_check(tmp_path: Path) -> None:
    import gpu_check

    check = gpu_check.Check(cpu=True, work=tmp_path, base={}, threads=None, coco_images=0)

    def run(spec: dict[str, Any]) -> dict[str, Any]:
        row = {"captions_per_s": 10.0, "step_ms": 1.0, "peak_mb": 0.0, "notes": "n"}
        with open(spec["rows_file"], "a") as f:
            f.write("".join(json.dumps(row) + "\n" for _ in spec["settings"]))
        raise RuntimeError("benchmark worker beam failed (exit -6)")

    check.run = run  # type: ignore[method-assign]
    gpu_check.stage_beam(check)
    assert len(check.rows) == 9 and check.failed
    assert (check.rows[-1]["config"], check.rows[-1]["result"]) == (
        "the worker, after its last setting", "FAILED")
