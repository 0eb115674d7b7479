"""The smaller benchmark scripts that docs/benchmarks.md shows, run at a tiny size."""

from __future__ import annotations

import subprocess
import sys

from tiny_runs import REPO
from trained import Trained


def _run(args: list[str]) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_benchmark_beam_batched_gives_the_one_at_a_time_captions() -> None:
    out = _run(["scripts/benchmark_beam.py", "--n", "4", "--beam-size", "2", "--batch-size",
                "2", "--max-len", "3", "--device", "cpu", "--threads", "1", "--locations", "4",
                "--dim", "8", "--vocab-size", "12"])
    assert "batched (2/call):" in out.stdout and "one at a time:" in out.stdout
    # <end> disabled: every image runs --max-len steps, and both modes find the same captions
    assert "mean steps per image: 3.0" in out.stdout
    assert "same captions: 4/4" in out.stdout


def test_bench_cider_times_the_reward_and_compares_with_pycocoevalcap() -> None:
    out = _run(["scripts/bench_cider.py", "--images", "20", "--vocab", "50", "--batch", "2",
                "--samples", "2", "--max-len", "4", "--repeats", "2", "--compare"])
    log = out.stderr
    assert "CiderD over 20 images × 5 references" in log
    assert "reward:" in log and "per batch of 2 images × 2 samples" in log
    assert "decoder.step (demo size, 4 rows" in log
    assert "pycocoevalcap CiderScorer:" in log


def test_benchmark_beam_with_a_checkpoint_and_images(trained: Trained) -> None:
    """The form docs/benchmarks.md shows: a trained model's beam search on real images."""
    images = [str(p) for p in trained.images[:3]]
    out = _run(["scripts/benchmark_beam.py", "--checkpoint", str(trained.checkpoint),
                "--images", *images, "--n", "3", "--beam-size", "2", "--batch-size", "2",
                "--max-len", "4", "--device", "cpu", "--threads", "1", "--fast-beam", "fixed"])
    assert "batched (2/call):" in out.stdout and "same captions: 3/3" in out.stdout
    # over fixed shapes too (captions of this model end at several steps), a padded last batch
    assert "fast_beam fixed (2/call):" in out.stdout
    assert "same captions as batched: 3/3" in out.stdout
