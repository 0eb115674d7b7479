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

import pytest
import torch
import yaml
from tiny_runs import REPO, cli_config

from captioning.checkpoint import CHECKPOINT_RNG_KEY
from captioning.data.datamodule import CaptionDataModule
from captioning.launch import fresh_launch_env, launcher_rank_zero

BIN = Path(sys.executable).parent


def _dataset_pairs(shapes_dm_kwargs: dict[str, Any], cache_dir: Path) -> Counter:
    """Every (image id, caption token ids) training pair of the tiny data, with multiplicity."""
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 8, "feature_cache": False,
                              "cache_dir": str(cache_dir)})
    ds = dm.dataset_for("train")
    return Counter((str(ds.image_ids[int(ds.pair_record[i])]), tuple(ds.encoded[i].tolist()))
                   for i in range(len(ds)))


def _torchrun_fit(cfg: Path, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = fresh_launch_env(os.environ)
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [str(REPO / "tests"), *filter(None, [env.get("PYTHONPATH")])]))
    return subprocess.run(
        [str(BIN / "torchrun"), "--standalone", "--nproc_per_node", "2", "--no-python",
         str(BIN / "captioning"), "fit", "--config", str(cfg), "--trainer.accelerator", "cpu",
         "--trainer.devices", "2", "--trainer.strategy", "ddp"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("on_device", [False, True], ids=["loader", "grids_on_device"])
def test_torchrun_two_processes_train_one_epoch(shapes_dm_kwargs: dict[str, Any],
                                                tmp_path: Path, on_device: bool) -> None:
    """With `features_on_device` too: each rank holds the grids, after both agree they fit."""
    ckpt_dir, pairs_dir = tmp_path / "ckpt", tmp_path / "pairs"
    record = {"class_path": "launch_helpers.RecordRankPairs",
              "init_args": {"folder": str(pairs_dir)}}
    cfg = cli_config(tmp_path / "fit.yaml", shapes_dm_kwargs, tmp_path / "features", ckpt_dir,
                     callbacks=[record], limit_train_batches=1.0, max_epochs=1)
    if on_device:
        config = yaml.safe_load(cfg.read_text())
        config["data"]["features_on_device"] = True
        cfg.write_text(yaml.safe_dump(config))
    proc = _torchrun_fit(cfg, tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]

    lines = {r: [json.loads(x) for x in (pairs_dir / f"rank{r}.jsonl").read_text().splitlines()]
             for r in (0, 1)}
    assert {line["world"] for r in lines for line in lines[r]} == {2}
    assert {line["input_dims"] for r in lines for line in lines[r]} == {3}  # grids, gathered
    held = proc.stderr.count("grids of the train split on cpu")
    assert held == (2 if on_device else 0), proc.stderr[-3000:]  # by each rank
    # each rank held them once, asking every rank's verdict (the loader's path holds nothing)
    assert {tuple(line["holds"]) for r in lines for line in lines[r]} == {
        (True,) if on_device else ()}
    assert len(lines[0]) == len(lines[1]) > 0  # both ranks trained, step for step
    seen = Counter((i, tuple(c)) for r in lines for line in lines[r] for i, c in line["pairs"])
    expected = _dataset_pairs(shapes_dm_kwargs, tmp_path / "features")
    assert sum(expected.values()) % 2 == 0  # no DistributedSampler padding: each pair once
    assert seen == expected  # every training pair exactly once in the epoch, across ranks

    assert sorted(p.name for p in ckpt_dir.iterdir()) == ["last.ckpt"]  # one, by rank zero
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == len(lines[0])  # one optimiser step per batch of each rank
    assert len(ckpt[CHECKPOINT_RNG_KEY]["ranks"]) == 2  # each rank's own random streams


@pytest.mark.parametrize(("signal_name", "said", "step"), [
    ("SIGTERM", "SIGTERM", 2), ("SIGINT", "Ctrl-C", 2), ("SIGTERM", "SIGTERM", None)],
    ids=["sigterm", "ctrl-c", "sigterm-in-the-sanity-check"])
def test_a_signal_to_one_rank_stops_every_rank_after_the_same_batch(
        shapes_dm_kwargs: dict[str, Any], tmp_path: Path, signal_name: str, said: str,
        step: int | None) -> None:
    """Rank 1 alone is signalled as step 2 starts: both ranks finish that batch, stop, and
    save one last.ckpt at step 3 together, none left waiting in a collective. Signalled in
    the sanity check: both stop after the first step."""
    ckpt_dir, pairs_dir = tmp_path / "ckpt", tmp_path / "pairs"
    callbacks = [{"class_path": "launch_helpers.RecordRankPairs",
                  "init_args": {"folder": str(pairs_dir)}},
                 {"class_path": "launch_helpers.SignalOneRank",
                  "init_args": {"rank": 1, "step": step, "signal_name": signal_name}}]
    cfg = cli_config(tmp_path / "fit.yaml", shapes_dm_kwargs, tmp_path / "features", ckpt_dir,
                     callbacks=callbacks, limit_train_batches=1.0, max_epochs=20,
                     num_sanity_val_steps=1)
    proc = _torchrun_fit(cfg, tmp_path)
    assert proc.returncode != 0, proc.stderr[-3000:]  # an interrupted run says so
    steps = {r: len((pairs_dir / f"rank{r}.jsonl").read_text().splitlines()) for r in (0, 1)}
    stop = 1 if step is None else step + 1
    assert steps == {0: stop, 1: stop}, proc.stderr[-3000:]  # the same steps on each rank
    ckpt = torch.load(ckpt_dir / "last.ckpt", map_location="cpu", weights_only=True)
    assert ckpt["global_step"] == stop
    assert len(ckpt[CHECKPOINT_RNG_KEY]["ranks"]) == 2  # saved by both ranks together
    lines = [line for line in proc.stderr.splitlines() if f"interrupted by {said};" in line]
    assert len(lines) == 2 and all("last.ckpt" in line for line in lines), proc.stderr[-3000:]


SRUN_STUB = """#!/bin/bash
# srun for the test: log the command, then run it here as one task with the test's overrides.
while [[ $# -gt 0 && $1 == --* ]]; do shift 2; done   # srun's own options, each with a value
[[ $1 == captioning ]] && shift
echo "$*" >> "$SRUN_LOG"
[[ -n ${SRUN_DRY:-} ]] && exit 0
mapfile -t extra < "$SRUN_EXTRA"
exec "$PYTHON" -m captioning.cli "$@" "${extra[@]}"
"""


def _sbatch(tmp_path: Path, nodes: int, tasks: int, **env: str) -> list[list[str]]:
    """Run scripts/slurm_train.sbatch under bash, as SLURM would on `nodes` x `tasks`, with a
    stub `srun` on PATH; the srun commands it gave, split into words."""
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir(exist_ok=True)
    stub.write_text(SRUN_STUB)
    stub.chmod(0o755)
    log = tmp_path / "srun.log"
    log.unlink(missing_ok=True)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "WANDB_"))}
    proc = subprocess.run(
        ["bash", str(REPO / "scripts" / "slurm_train.sbatch")], cwd=tmp_path,
        capture_output=True, text=True, timeout=900,
        env={**base, "PATH": f"{stub.parent}{os.pathsep}{base['PATH']}", "PYTHON": sys.executable,
             "SRUN_LOG": str(log), "SLURM_NTASKS_PER_NODE": str(tasks),
             "SLURM_JOB_NUM_NODES": str(nodes), "OMP_NUM_THREADS": "1", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [line.split() for line in log.read_text().splitlines()]


def _flag(words: list[str], name: str) -> str:
    return words[words.index(name) + 1]


def test_slurm_script_composes_the_launch(tmp_path: Path) -> None:
    """On 2 nodes x 8 GPUs: the cache once, then `fit` on every task, with the nodes, the GPUs
    per node and the square-root learning rate of 16 GPUs."""
    cache, fit = _sbatch(tmp_path, 2, 8, SRUN_DRY="1", DATA="/data/coco")
    assert cache[0] == "cache-features"
    assert _flag(cache, "--data.cache_dir") == "/data/coco/features"
    assert fit[0] == "fit" and fit[fit.index("--config") + 1] == "trainer/gpu_ddp"
    assert (_flag(fit, "--trainer.num_nodes"), _flag(fit, "--trainer.devices")) == ("2", "8")
    assert abs(float(_flag(fit, "--model.decoder_lr")) - 2e-4 * 16 ** 0.5) < 1e-12
    assert _flag(fit, "--ckpt_path") == "last"


def test_slurm_script_runs_shrunk(tmp_path: Path) -> None:
    """The script's two commands run for real on one node x one task, shrunk to the CPU: the
    cache is built, then `fit` trains on it (from scratch: there is no last.ckpt yet) and
    leaves last.ckpt."""
    from conftest import paper_shrink_args, write_tiny_coco

    from captioning.commands.lightning import wandb_dirs

    write_tiny_coco(tmp_path / "coco")
    (tmp_path / "extra.txt").write_text("\n".join(paper_shrink_args(tmp_path)) + "\n")
    cache, fit = _sbatch(tmp_path, 1, 1, DATA=str(tmp_path / "coco"),
                         CACHE=str(tmp_path / "cache"), SRUN_EXTRA=str(tmp_path / "extra.txt"),
                         WANDB_MODE="offline", **wandb_dirs(tmp_path))
    assert cache[0] == "cache-features" and fit[0] == "fit"
    assert list((tmp_path / "cache").rglob("*.npy")), "the feature cache was built"
    ckpt = torch.load(tmp_path / "runs" / "paper" / "checkpoints" / "last.ckpt",
                      weights_only=True)
    assert ckpt["global_step"] == 2


def test_slurm_script_parses() -> None:
    script = REPO / "scripts" / "slurm_train.sbatch"
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    text = script.read_text()
    assert "srun captioning fit" in text and "#SBATCH --ntasks-per-node" in text


def test_a_child_launch_drops_the_parents_ranks_and_keeps_the_rest() -> None:
    parent = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "node0",
              "MASTER_PORT": "29500", "NODE_RANK": "0", "GROUP_WORLD_SIZE": "1",
              "ROLE_NAME": "default", "TORCHELASTIC_RUN_ID": "job", "SLURM_PROCID": "1",
              "SLURM_NTASKS": "2", "PATH": "/usr/bin", "OMP_NUM_THREADS": "4",
              "MY_RANK_NOTE": "kept"}
    assert fresh_launch_env(parent) == {"PATH": "/usr/bin", "OMP_NUM_THREADS": "4",
                                        "MY_RANK_NOTE": "kept"}
    assert parent["RANK"] == "1"  # the parent's own environment is left as it was


@pytest.mark.parametrize(("env", "zero"), [
    ({}, True), ({"RANK": "0", "LOCAL_RANK": "0", "NODE_RANK": ""}, True),
    ({"RANK": "3"}, False), ({"LOCAL_RANK": "1"}, False), ({"NODE_RANK": "1"}, False),
    ({"SLURM_PROCID": "2"}, False)])
def test_rank_zero_is_read_from_any_launchers_variables(env: dict[str, str], zero: bool) -> None:
    assert launcher_rank_zero(env) is zero
