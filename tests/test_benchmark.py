"""`scripts/benchmark.py` runs end to end at a tiny size (it builds through `captioning fit`'s
parser and configs, so a change there that breaks it fails here)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_prints_its_table_at_a_tiny_size(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "scripts/benchmark.py", "--tiny", "--rows", "cached,beam",
         "--steps", "2", "--rounds", "1", "--warmup", "1", "--num-train", "16",
         "--batch-size", "4", "--threads", "1", "--workdir", str(tmp_path / "work"),
         "--json", str(tmp_path / "bench.json")],
        cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("train, cached, soft", "train, cached, hard", "beam search, cached, soft"):
        assert f"| {row}" in out.stdout
    assert "padding share of one epoch's (B, T) step-rows, shapes" in out.stdout
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert all(r["captions_per_s"] > 0 for r in rows.values())
