"""The multi-process launches of the README's "Many GPUs, many nodes": `torchrun` starts two
`captioning fit` processes (gloo, CPU) that train one epoch together, and the SLURM script
parses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from tiny_runs import cli_config

from captioning.data.datamodule import CaptionDataModule

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _dataset_pairs(shapes_dm_kwargs: dict[str, Any], cache_dir: Path) -> Counter:
    """Every (image id, caption token ids) training pair of the tiny data, with multiplicity."""
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 8, "feature_cache": False,
                              "cache_dir": str(cache_dir)})
    ds = dm.dataset_for("train")
    return Counter((str(ds.image_ids[int(ds.pair_record[i])]), tuple(ds.encoded[i].tolist()))
                   for i in range(len(ds)))


def _torchrun_fit(cfg: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (
        "LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "NODE_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(ROOT / "tests"), *filter(None, [env.get("PYTHONPATH")])]))
    return subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "--no-python",
         str(BIN / "captioning"), "fit", "--config", str(cfg), "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--trainer.strategy", "ddp"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


def test_torchrun_two_processes_train_one_epoch(shapes_dm_kwargs: dict[str, Any],
                                                tmp_path: Path) -> None:
    ckpt_dir, pairs_dir = tmp_path / "ckpt", tmp_path / "pairs"
    record = {"class_path": "launch_helpers.RecordRankPairs",
              "init_args": {"folder": str(pairs_dir)}}
    cfg = cli_config(tmp_path / "fit.yaml", shapes_dm_kwargs, tmp_path / "features", ckpt_dir,
                     callbacks=[record], limit_train_batches=1.0, max_epochs=1)
    proc = _torchrun_fit(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    lines = {r: [json.loads(x) for x in (pairs_dir / f"rank{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)}
    assert {line["world"] for r in lines for line in lines[r]} == {2}
    assert len(lines[0]) == len(lines[1]) > 0  # both ranks trained, step for step
    seen = Counter((i, tuple(c)) for r in lines for line in lines[r] for i, c in line["pairs"])
    expected = _dataset_pairs(shapes_dm_kwargs, tmp_path / "features")
    assert sum(expected.values()) % 2 == 0  # no DistributedSampler padding: each pair once
    assert seen == expected  # every training pair exactly once in the epoch, across ranks

    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]  # one, by rank zero
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == len(lines[0])  # one optimiser step per batch of each rank


def test_slurm_script_parses() -> None:
    script = ROOT / "scripts" / "slurm_train.sbatch"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "srun captioning fit" in text and "#SBATCH --ntasks-per-node" in text
