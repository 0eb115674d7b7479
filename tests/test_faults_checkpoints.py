"""Fault injection, checkpoints (issue 14, "Checkpoints"): one test per row found.

* `last.ckpt` is the newest state (every epoch end, every N steps; the best kept apart), and
  a `kill -9` within an epoch resumes from the latest step, continuing that epoch exactly.
* a full disk or a `kill -9` during a save leaves the previous checkpoint intact.
* `--ckpt_path last|best|FOLDER` goes through the same checks as a path; a run folder means
  its checkpoints/last.ckpt; `validate`/`test` without weights and resuming past
  `max_epochs` are one line.
* a checkpoint without Lightning's keys is one line.
* an explicit architecture flag that disagrees with the checkpoint is one line.

The runs are the tiny ones of tiny_runs.py (15 batches of 8 pairs per epoch, or 3 with
`limit_train_batches`); the processes that are killed or limited run `captioning.cli` as
children, with the tests folder on their path.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import resource
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
import yaml
from tiny_runs import (
    BATCHES,
    REPO,
    InterruptAt,
    RecordPairs,
    assert_same,
    cli_config,
    error_lines,
    latest_trainer,
    make_dm,
    make_module,
    snapshot,
    with_latest,
)
from torch.utils.data.distributed import DistributedSampler

from captioning.callbacks import AtomicCheckpointIO
from captioning.checkpoint import load_checkpoint, save_inference_checkpoint
from captioning.cli import main
from captioning.data.samplers import (
    BucketBatchSampler,
    EpochShuffleSampler,
    ResumableDataLoader,
)
from captioning.vocab import Vocabulary

pytestmark = pytest.mark.usefixtures("signal_handlers_restored")

PAIRS, FULL = 120, 15  # training pairs, and batches of 8 in a full epoch


# ------------------------------------------------------------------------------------------
# Helpers


@pytest.fixture(scope="module")
def run(shapes_dm_kwargs: dict, cache_dir: Path, tmp_path_factory: pytest.TempPathFactory
        ) -> Path:
    """The checkpoint folder of a finished 2-epoch run (3 batches each) in the shipped
    configs' layout: last.ckpt and best-XX.ckpt."""
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    ckpt_dir = tmp_path_factory.mktemp("run") / "ckpt"
    latest_trainer(ckpt_dir, limit_train_batches=BATCHES).fit(make_module(dm), datamodule=dm)
    return ckpt_dir


@pytest.fixture
def ckpt_dir(run: Path, tmp_path: Path) -> Path:
    """A copy of `run` for one test to damage."""
    return Path(shutil.copytree(run, tmp_path / "ckpt"))


def config(tmp_path: Path, shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path,
           callbacks: list[dict[str, Any]] = (), name: str = "cfg.yaml",
           latest: dict[str, Any] | None = None, **trainer: Any) -> Path:
    """A `captioning fit` config of the tiny run, with the shipped checkpoint layout."""
    return with_latest(cli_config(tmp_path / name, shapes_dm_kwargs, cache_dir, ckpt_dir,
                                  list(callbacks), **trainer), **(latest or {}))


def child(args: list[str], cwd: Path, **popen: Any) -> subprocess.Popen[str]:
    """`python -m captioning.cli ARGS` in a child process, with tiny_runs importable."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    return subprocess.Popen([sys.executable, "-m", "captioning.cli", *args], cwd=cwd, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def step_of(path: Path) -> int:
    return int(torch.load(path, map_location="cpu", weights_only=True)["global_step"])


def score_of(path: Path) -> float:
    """The monitored score of the best checkpoint `path` (its ModelCheckpoint's state)."""
    callbacks = torch.load(path, map_location="cpu", weights_only=True)["callbacks"]
    (score,) = {float(v["best_model_score"]) for k, v in callbacks.items()
                if k.startswith("ModelCheckpoint") and v.get("best_model_score") is not None}
    return score


def epoch_pairs(path: Path, epoch: int) -> Counter:
    """The (image id, caption) pairs that RecordPairs wrote for `epoch`."""
    seen: Counter = Counter()
    for line in path.read_text().splitlines():
        e, pairs = json.loads(line)
        if e == epoch:
            seen.update((i, tuple(c)) for i, c in pairs)
    return seen


# ------------------------------------------------------------------------------------------
# `last.ckpt` is the newest state


class RecordingIO(AtomicCheckpointIO):
    """Remember (file name, global step) of every save."""

    def __init__(self) -> None:
        super().__init__()
        self.saved: list[tuple[str, int]] = []

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any = None
                        ) -> None:
        super().save_checkpoint(checkpoint, path, storage_options)
        self.saved.append((Path(path).name, int(checkpoint["global_step"])))


def test_last_ckpt_is_the_newest_state_and_the_best_is_kept_apart(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    # Row: a finished 2-epoch run ended with last.ckpt at epoch 0 (rewritten only when val
    # BLEU-4 improved), and there was no checkpoint within an epoch.
    L.seed_everything(0)
    dm = make_dm(shapes_dm_kwargs, cache_dir)
    io = RecordingIO()
    trainer = latest_trainer(tmp_path / "ckpt", every_n_train_steps=2, plugins=[io],
                             limit_train_batches=BATCHES)
    trainer.fit(make_module(dm), datamodule=dm)
    last = [step for name, step in io.saved if name == "last.ckpt"]
    assert last == [2, 3, 4, 6]  # every 2 steps and every epoch end (3, 6)
    assert step_of(tmp_path / "ckpt" / "last.ckpt") == 2 * BATCHES
    best = [name for name, _ in io.saved if name.startswith("best-")]
    assert best and all(name != "last.ckpt" for name in best)
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == sorted({best[-1],
                                                                            "last.ckpt"})


def test_shipped_configs_write_last_ckpt_atomically_and_apart_from_the_best() -> None:
    from captioning.commands.configs import CONFIG_DIR

    for name in ("cpu", "gpu"):
        trainer = yaml.safe_load((CONFIG_DIR / "trainer" / f"{name}.yaml").read_text())["trainer"]
        assert trainer["plugins"] == [{"class_path": "captioning.callbacks.AtomicCheckpointIO"}]
        classes = {cb["class_path"]: cb.get("init_args", {}) for cb in trainer["callbacks"]}
        assert classes["lightning.pytorch.callbacks.ModelCheckpoint"]["save_last"] is False
        latest = classes["captioning.callbacks.LatestCheckpoint"]
        mid_epoch = latest["every_n_train_steps"] or latest["every_n_minutes"]
        assert bool(mid_epoch) == (name == "gpu")  # the demo's runs stay as they were


def test_kill_9_mid_epoch_resumes_from_the_latest_step_continuing_the_epoch(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: after `kill -9` in epoch 3, `--ckpt_path last` resumed from epoch 0.
    ckpt_dir, before, after = tmp_path / "ckpt", tmp_path / "before.jsonl", tmp_path / "after.jsonl"
    kill = {"class_path": "tiny_runs.KillAt", "init_args": {"epoch": 1, "batch": 5}}
    record = {"class_path": "tiny_runs.RecordPairs", "init_args": {"path": str(before)}}
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, [kill, record],
                 name="killed.yaml", latest={"every_n_train_steps": 4}, max_epochs=3,
                 limit_train_batches=None)
    proc = child(["fit", "--config", str(cfg)], tmp_path)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == -signal.SIGKILL, err
    # Saved at step 20, after batch 4 of epoch 1: the newest state, not the end of epoch 0.
    assert step_of(ckpt_dir / "last.ckpt") == FULL + 5

    record["init_args"]["path"] = str(after)
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, [record], name="resume.yaml",
                 max_epochs=2, limit_train_batches=None)
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last"]) == 0
    assert "not resumable" not in capsys.readouterr().err
    assert step_of(ckpt_dir / "last.ckpt") == 2 * FULL
    # Epoch 1: the 5 batches before the kill and the 10 after it are each pair exactly once.
    seen = epoch_pairs(before, 1) + epoch_pairs(after, 1)
    assert sum(seen.values()) == PAIRS and seen == epoch_pairs(before, 0)
    assert not epoch_pairs(after, 0)


def test_mid_epoch_resume_equals_an_uninterrupted_run(shapes_dm_kwargs: dict, cache_dir: Path,
                                                       tmp_path: Path) -> None:
    # The same row, in process: weights, optimiser and data order are those of a straight run.
    def fit(*callbacks: L.Callback, folder: str, ckpt_path: str | None = None,
            seed: int = 0) -> tuple[dict[str, Any], Path]:
        L.seed_everything(seed)
        dm = make_dm(shapes_dm_kwargs, cache_dir)
        module = make_module(dm)
        pairs = tmp_path / f"{folder}.jsonl"
        trainer = latest_trainer(tmp_path / folder, RecordPairs(str(pairs)), *callbacks)
        trainer.fit(module, datamodule=dm, ckpt_path=ckpt_path, weights_only=True)
        return snapshot(module, trainer), pairs

    expected, straight = fit(folder="straight")
    with pytest.raises(SystemExit):  # SIGTERM after batch 6 of epoch 1: last.ckpt at step 22
        fit(InterruptAt("SIGTERM", epoch=1, batch=6), folder="ckpt")
    assert step_of(tmp_path / "ckpt" / "last.ckpt") == FULL + 7
    got, pairs = fit(folder="ckpt", ckpt_path="last", seed=123)
    assert pairs.read_text() == straight.read_text()  # 22 batches, then the 8 after them
    assert_same(got, expected)


@pytest.mark.parametrize("workers", [0, 1])
def test_resumable_loader_continues_each_ddp_shard(workers: int) -> None:
    # DDP: every rank continues its own shard from rank 0's saved position.
    n, batch, done = 50, 4, 3
    lengths = np.random.default_rng(0).integers(3, 20, size=n)

    def loader(rank: int) -> ResumableDataLoader:
        shard = DistributedSampler(range(n), num_replicas=2, rank=rank, shuffle=True, seed=0)
        sampler = BucketBatchSampler(shard, batch, lengths=lengths, bucket_size_multiplier=2)
        return ResumableDataLoader(list(range(n)), batch_sampler=sampler, num_workers=workers)

    for rank in range(2):
        first = loader(rank)
        first.batch_sampler.set_epoch(2)
        whole = [b.tolist() for b in first]
        it = iter(first)
        head = [next(it).tolist() for _ in range(done)]
        state = first.state_dict() if rank == 0 else state  # noqa: F821 (rank 0's, as saved)
        assert state == {"epoch": 2, "batches": done}
        again = loader(rank)
        again.load_state_dict(state)
        again.batch_sampler.set_epoch(2)  # as Lightning does before the epoch
        assert head + [b.tolist() for b in again] == whole
        assert again.state_dict() == {"epoch": 2, "batches": len(whole)}
        again.batch_sampler.set_epoch(3)  # the next epoch: a whole pass again
        assert again.state_dict() == {"epoch": 3, "batches": 0}
        assert len(list(again)) == len(whole)


def test_workers_start_the_epoch_lightning_set() -> None:
    # Lightning makes the first iterator before it sets the epoch (resuming at an epoch
    # boundary): with workers, the batch order must still be the epoch's.
    lengths = np.random.default_rng(0).integers(3, 20, size=40)
    sampler = BucketBatchSampler(EpochShuffleSampler(40, seed=0), 4, lengths=lengths)
    loader = ResumableDataLoader(list(range(40)), batch_sampler=sampler, num_workers=1)
    sampler.set_epoch(3)
    expected = [b.tolist() for b in loader]
    sampler.set_epoch(0)
    it = iter(loader)
    sampler.set_epoch(3)
    assert [b.tolist() for b in it] == expected


# ------------------------------------------------------------------------------------------
# A full disk or a kill during a save keeps the good checkpoint


def test_full_disk_during_a_save_keeps_the_previous_checkpoint(
        shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path, tmp_path: Path) -> None:
    # Row: with ENOSPC during the save, last.ckpt was left at 0 bytes.
    before = {p.name: digest(p) for p in ckpt_dir.iterdir()}
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, max_epochs=3)

    def limit() -> None:  # a file-size limit: writes past 1 MiB fail with EFBIG
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))

    proc = child(["fit", "--config", str(cfg), "--ckpt_path", "last"], tmp_path,
                 preexec_fn=limit)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 1, err
    (line,) = error_lines(err)
    assert "could not save the checkpoint" in line and "previous file" in line
    assert {p.name: digest(p) for p in ckpt_dir.iterdir()} == before  # nothing partial either
    assert step_of(ckpt_dir / "last.ckpt") == 2 * BATCHES


def test_kill_9_during_a_save_keeps_the_previous_checkpoint(
        shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path, tmp_path: Path) -> None:
    # Row: `kill -9` during the copy over last.ckpt left it at 0 bytes.
    before = {p.name: digest(p) for p in ckpt_dir.iterdir()}
    marker = tmp_path / "saving"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, max_epochs=3)
    data = yaml.safe_load(cfg.read_text())
    data["trainer"]["plugins"] = [{"class_path": "tiny_runs.BlockingCheckpointIO",
                                   "init_args": {"marker": str(marker), "block_at": 1}}]
    cfg.write_text(yaml.safe_dump(data))
    proc = child(["fit", "--config", str(cfg), "--ckpt_path", "last"], tmp_path)
    deadline = time.monotonic() + 300
    while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    assert marker.exists(), proc.communicate()[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=60)
    after = {p.name: digest(p) for p in ckpt_dir.iterdir() if not p.name.endswith(".tmp")}
    assert after == before  # every checkpoint name holds its old, complete file
    (tmp,) = [p for p in ckpt_dir.iterdir() if p.name.endswith(".tmp")]
    assert tmp.name.startswith(".") and f".{proc.pid}." in tmp.name

    # The next run removes the dead writer's temporary file and resumes the intact last.ckpt.
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, name="again.yaml",
                 max_epochs=3)
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last"]) == 0
    assert not list(ckpt_dir.glob("*.tmp"))
    assert step_of(ckpt_dir / "last.ckpt") == 3 * BATCHES


# ------------------------------------------------------------------------------------------
# --ckpt_path last | best | FOLDER: one check


def test_ckpt_path_last_gets_the_checks_and_names_an_older_good_checkpoint(
        shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: given as `last`, a truncated file gave a PytorchStreamReader traceback.
    last = ckpt_dir / "last.ckpt"
    (best,) = ckpt_dir.glob("best-*.ckpt")
    last.write_bytes(last.read_bytes()[:5000])
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir, max_epochs=3)
    for command in ("fit", "test"):
        assert main([command, "--config", str(cfg), "--ckpt_path", "last"]) == 1
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: {last}: not a readable PyTorch checkpoint")
        assert f"an older good checkpoint exists: {best} (epoch " in line
    last.unlink()  # missing, beside a good one: named, not used
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last"]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{last} does not exist; an older good checkpoint exists: {best}" in line


def test_ckpt_path_best_and_folders_resolve_to_checked_files(
        shapes_dm_kwargs: dict, cache_dir: Path, ckpt_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    (best,) = ckpt_dir.glob("best-*.ckpt")
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir)
    assert main(["test", "--config", str(cfg), "--ckpt_path", "best"]) == 0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["ckpt_path"] == str(best)
    best.write_bytes(b"")  # the best, truncated: one line naming it
    assert main(["test", "--config", str(cfg), "--ckpt_path", "best"]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {best}: not a readable PyTorch checkpoint")
    (ckpt_dir / "last.ckpt").write_bytes(b"\0" * 100)  # a folder means its last.ckpt
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(ckpt_dir)]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {ckpt_dir / 'last.ckpt'}: not a readable")


def test_fit_ckpt_path_last_without_any_checkpoint_starts_afresh(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["test", "--config", str(cfg), "--ckpt_path", "last"]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"--ckpt_path last: no checkpoint in {tmp_path / 'ckpt'}" in line
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last"]) == 0
    assert step_of(tmp_path / "ckpt" / "last.ckpt") == BATCHES


def test_sigterm_during_validation_resumes_into_that_validation(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    # Row: SIGTERM during the epoch's validation saved a checkpoint whose resume skipped that
    # validation: no val score for the epoch, and no best checkpoint.
    ckpt = tmp_path / "ckpt"
    stop = {"class_path": "tiny_runs.InterruptAt", "init_args": {"epoch": 0, "val_batch": 0}}
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt, [stop], name="stop.yaml",
                 limit_val_batches=None)
    args = ["--data.eval_batch_size", "2"]  # 4 val batches
    assert main(["fit", "--config", str(cfg), *args]) == 143
    assert step_of(ckpt / "last.ckpt") == BATCHES and not list(ckpt.glob("best-*.ckpt"))
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt, name="resume.yaml",
                 limit_val_batches=None)
    assert main(["fit", "--config", str(cfg), *args, "--ckpt_path", "last"]) == 0
    (best,) = ckpt.glob("best-*.ckpt")  # the epoch's validation ran: a monitored score
    assert step_of(best) == BATCHES
    # over every val batch, not those after the interruption: an uninterrupted run's score
    whole = tmp_path / "whole"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, whole, name="whole.yaml",
                 limit_val_batches=None)
    assert main(["fit", "--config", str(cfg), *args]) == 0
    scores = [score_of(next(folder.glob("best-*.ckpt"))) for folder in (ckpt, whole)]
    assert scores[0] == pytest.approx(scores[1], rel=1e-6)


def test_sigterm_while_the_validation_is_scored_saves_a_checkpoint_into_it(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGTERM while the validation's captions are scored (`Terminated`, from the scorer's
    `sigterm_raises`) stops the fit like a SIGTERM anywhere in the validation: exit 143 and a
    last.ckpt that resumes into that validation. Before, nothing was saved."""
    import captioning.lit_module as lit_module
    from captioning.locks import Terminated

    def scoring(*args: Any, **kwargs: Any) -> dict[str, float]:
        raise Terminated("interrupted by SIGTERM")

    monkeypatch.setattr(lit_module, "compute_metrics", scoring)
    ckpt = tmp_path / "ckpt"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt, name="stop.yaml")
    assert main(["fit", "--config", str(cfg), "--model.compute_metrics", "true"]) == 143
    assert step_of(ckpt / "last.ckpt") == BATCHES
    val = torch.load(ckpt / "last.ckpt", map_location="cpu", weights_only=True)["loops"][
        "fit_loop"]["epoch_loop.val_loop.batch_progress"]
    assert val["current"]["completed"] == 0  # resumed into the validation, from its start


def test_an_interruption_at_the_validations_end_counts_it_once(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    # Row: a second Ctrl-C after EarlyStopping's on_validation_end ran saved its patience with
    # that validation counted, and the resumed run counted the validation again.
    early = {"class_path": "lightning.pytorch.callbacks.EarlyStopping",
             "init_args": {"monitor": "val/loss", "patience": 3,
                           "check_on_train_epoch_end": False}}
    stop = {"class_path": "tiny_runs.InterruptAt",
            "init_args": {"how": "KeyboardInterrupt", "epoch": 0, "val_hook": "end"}}

    def early_state(path: Path) -> dict[str, Any]:
        states = torch.load(path, map_location="cpu", weights_only=True)["callbacks"]
        (state,) = (v for k, v in states.items() if k.startswith("EarlyStopping"))
        return state

    ckpt, whole = tmp_path / "ckpt", tmp_path / "whole"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt, [early, stop], name="stop.yaml")
    assert main(["fit", "--config", str(cfg)]) != 0
    assert early_state(ckpt / "last.ckpt")["best_score"].isinf()  # as validation started
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt, [early], name="resume.yaml")
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last"]) == 0
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, whole, [early], name="whole.yaml")
    assert main(["fit", "--config", str(cfg)]) == 0
    resumed, uninterrupted = early_state(ckpt / "last.ckpt"), early_state(whole / "last.ckpt")
    assert resumed["wait_count"] == uninterrupted["wait_count"] == 0
    assert float(resumed["best_score"]) == pytest.approx(float(uninterrupted["best_score"]))
    # Interrupted as the next validation starts, before this callback kept its states: the
    # states saved are the live ones, not those kept as the epoch before's validation started.
    stop["init_args"].update(epoch=1, val_hook="start")
    again = tmp_path / "again"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, again, [early, stop], name="again.yaml")
    spec = yaml.safe_load(cfg.read_text())
    spec["trainer"]["callbacks"].sort(key=lambda c: "InterruptAt" not in c["class_path"])
    cfg.write_text(yaml.safe_dump(spec))  # it runs before CheckpointOnInterrupt
    assert main(["fit", "--config", str(cfg), "--trainer.max_epochs", "2"]) != 0
    assert step_of(again / "last.ckpt") == 2 * BATCHES
    assert float(early_state(again / "last.ckpt")["best_score"]) == pytest.approx(
        float(uninterrupted["best_score"]))  # epoch 0's validation counted, as it ran


def test_evaluation_scores_with_the_checkpoints_own_vocabulary(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: `test` of a run whose data config builds its vocabulary each run (no vocab_path)
    # rebuilt it from today's captions and settings, and refused the checkpoint ("16 words is
    # not the data's 16 words").
    ckpt = tmp_path / "ckpt"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt)
    assert main(["fit", "--config", str(cfg)]) == 0
    trained = Vocabulary.from_dict(torch.load(ckpt / "last.ckpt", weights_only=True)
                                   ["captioning_vocab"])
    other = ["--data.max_vocab_size", "10"]  # today's data builds another vocabulary
    assert main(["test", "--config", str(cfg), *other, "--ckpt_path", "last"]) == 0
    assert Vocabulary.load(tmp_path / "checkpoint_vocab.json") == trained
    capsys.readouterr()
    assert main(["test", "--config", str(cfg), *other, "--ckpt_path", "last",  # given: kept
                 "--data.vocab_path", str(tmp_path / "mine.json")]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert "the checkpoint's vocabulary" in line and "of its words are not in the data's, e.g." in line


def test_a_new_fit_in_a_used_run_folder_sets_the_earlier_checkpoints_aside(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        caplog: pytest.LogCaptureFixture, capsys: pytest.CaptureFixture[str]) -> None:
    # Row: the same `fit` again without --ckpt_path overwrote the earlier run's last.ckpt (an
    # interrupted run's whole training) with a fresh run's first epoch.
    ckpt = tmp_path / "ckpt"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt)
    assert main(["fit", "--config", str(cfg)]) == 0
    first = (ckpt / "last.ckpt").read_bytes()
    assert main(["fit", "--config", str(cfg), "--ckpt_path", "last",  # resuming moves nothing
                 "--trainer.max_epochs", "2"]) == 0
    assert not (tmp_path / "ckpt.previous").exists() and step_of(ckpt / "last.ckpt") == 2 * BATCHES
    resumed = (ckpt / "last.ckpt").read_bytes()
    with caplog.at_level(logging.WARNING):
        assert main(["fit", "--config", str(cfg)]) == 0
    assert (tmp_path / "ckpt.previous" / "last.ckpt").read_bytes() == resumed
    assert step_of(ckpt / "last.ckpt") == BATCHES  # the new run's own
    assert any(f"moved the earlier run's checkpoints to {tmp_path / 'ckpt.previous'}" in
               r.getMessage() for r in caplog.records)
    assert main(["fit", "--config", str(cfg)]) == 0  # one past the highest number taken
    assert sorted(p.name for p in tmp_path.glob("ckpt*")) == [
        "ckpt", "ckpt.previous", "ckpt.previous-2"]
    assert first != resumed
    # A new stage started from a checkpoint among those it would set aside: refused, not lost.
    assert main(["fit", "--config", str(cfg), "--model.init_from", str(ckpt / "last.ckpt")]) == 2
    assert "lies in" in capsys.readouterr().err and (ckpt / "last.ckpt").is_file()


def test_the_run_folder_stays_held_while_the_caller_holds_the_claims(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path) -> None:
    """`ablate`'s cell tests after its fit: with `claims`, the run folder is held until the
    caller closes them, so that a re-run cannot remove the folder between fit and test."""
    import contextlib

    from captioning.commands.lightning import lightning_cli
    from captioning.locks import FolderInUseError, claim_folder

    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    with contextlib.ExitStack() as claims:
        lightning_cli(["fit", "--config", str(cfg)], claims=claims)
        with pytest.raises(FolderInUseError), claim_folder(tmp_path):
            pass
    with claim_folder(tmp_path):  # free once closed
        pass
    lightning_cli(["fit", "--config", str(cfg)])  # without: free on return
    with claim_folder(tmp_path):
        pass


def test_a_checkpoint_folder_outside_the_run_folder_is_held_by_its_fit(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: two runs, each in its own run folder, whose configs name one checkpoint folder: the
    # second's new fit set the running first one's checkpoints aside.
    import contextlib

    from captioning.commands.lightning import lightning_cli

    shared = tmp_path / "shared"
    first, second = (config(tmp_path, shapes_dm_kwargs, cache_dir, shared, name=f"{n}.yaml",
                            default_root_dir=str(tmp_path / n)) for n in ("a", "b"))
    with contextlib.ExitStack() as claims:  # the first run, still running
        lightning_cli(["fit", "--config", str(first)], claims=claims)
        saved = digest(shared / "last.ckpt")
        assert main(["fit", "--config", str(second)]) == 1
        (line,) = error_lines(capsys.readouterr().err)
        assert line == (f"error: {shared}: checkpoint folder in use by another run (pid "
                        f"{os.getpid()}); give this run its own folder")
        assert digest(shared / "last.ckpt") == saved and not (tmp_path / "shared.previous").exists()
    assert main(["fit", "--config", str(second)]) == 0  # once the first is done: set aside
    assert digest(tmp_path / "shared.previous" / "last.ckpt") == saved


def test_ckpt_path_run_folder_means_its_checkpoints_last_ckpt(
        shapes_dm_kwargs: dict, cache_dir: Path, run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: `--ckpt_path RUN` (checkpoints in RUN/checkpoints, the shipped configs' dirpath) was
    # refused as "a folder without last.ckpt".
    folder = tmp_path / "my-run"
    shutil.copytree(run, folder / "checkpoints")
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(folder)]) == 0
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())
    assert saved["ckpt_path"] == str(folder / "checkpoints" / "last.ckpt")
    (folder / "checkpoints" / "last.ckpt").unlink()  # the refusal lists where it looked
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(folder)]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"no {folder / 'last.ckpt'} nor {folder / 'checkpoints' / 'last.ckpt'}" in line
    (best,) = (folder / "checkpoints").glob("best-*.ckpt")
    assert f"it holds {best} (epoch " in line  # named, not used


@pytest.mark.parametrize("command", ["validate", "test"])
def test_evaluating_without_a_checkpoint_is_refused(
        command: str, shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: `test` without --ckpt_path scored the random initial weights (BLEU-4 ~1e-14) and
    # wrote results that pushed out the real ones.
    results = tmp_path / "results"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main([command, "--config", str(cfg), "--model.compute_metrics", "true",
                 "--model.results_dir", str(results)]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith(f"error: {command} needs trained weights: pass --ckpt_path with a "
                           "checkpoint file, `last`, `best`, a run folder or an exported model")
    assert not results.exists() and not (tmp_path / "config.yaml").exists()


def test_test_with_model_init_from_needs_no_ckpt_path(
        shapes_dm_kwargs: dict, cache_dir: Path, run: Path, tmp_path: Path) -> None:
    """`model.init_from` gives the weights too: scored as with --ckpt_path."""
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    args = ["test", "--config", str(cfg), "--model.compute_metrics", "true"]
    assert main([*args, "--model.init_from", str(run / "last.ckpt"),
                 "--model.results_dir", str(tmp_path / "a")]) == 0
    assert main([*args, "--ckpt_path", str(run / "last.ckpt"),
                 "--model.results_dir", str(tmp_path / "b")]) == 0
    got, want = (json.loads((tmp_path / r / "test_metrics.json").read_text()) for r in "ab")
    assert got == pytest.approx(want)


def test_resuming_past_max_epochs_is_one_line(shapes_dm_kwargs: dict, cache_dir: Path,
                                              ckpt_dir: Path, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    # Row: `fit --trainer.max_epochs 1 --ckpt_path last` of a 3-epoch run printed Lightning's
    # MisconfigurationException traceback.
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, ckpt_dir)
    assert main(["fit", "--config", str(cfg), "--trainer.max_epochs", "3",
                 "--ckpt_path", "last"]) == 0  # the 2-epoch run, one epoch more
    before = digest(ckpt_dir / "last.ckpt")
    assert main(["fit", "--config", str(cfg), "--trainer.max_epochs", "1",
                 "--ckpt_path", "last"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (f"error: --ckpt_path {ckpt_dir / 'last.ckpt'}: the checkpoint is at epoch 2 "
                    "(3 epochs trained), but trainer.max_epochs is 1; to train on from it pass "
                    "--trainer.max_epochs 4 or more, or start a new run without --ckpt_path")
    assert digest(ckpt_dir / "last.ckpt") == before
    # Lightning's own refusal (after the data setup), should it come first, reads the same way
    from captioning.commands.hints import restored_past_max

    lightning = ("You restored a checkpoint with current_epoch=10, but you have set "
                 "Trainer(max_epochs=2).")
    assert restored_past_max(lightning, "x.ckpt") == (
        "--ckpt_path x.ckpt: the checkpoint is at epoch 10, but trainer.max_epochs is 2; to "
        "train on from it pass a larger --trainer.max_epochs, or start a new run without "
        "--ckpt_path")
    assert restored_past_max("something else", "x.ckpt") is None


# ------------------------------------------------------------------------------------------
# Checkpoints without Lightning's keys


def test_checkpoints_without_lightnings_keys_are_one_line(
        shapes_dm_kwargs: dict, cache_dir: Path, run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: a torch.save({...}) file or the inference checkpoint gave KeyError tracebacks.
    plain = tmp_path / "plain.ckpt"
    torch.save({"weights": torch.zeros(2)}, plain)
    model = load_checkpoint(run / "last.ckpt")
    inference = save_inference_checkpoint(tmp_path / "inference.ckpt", model.captioner,
                                          model.vocab, model.decode)
    weights_only = tmp_path / "weights.ckpt"
    data = torch.load(run / "last.ckpt", map_location="cpu", weights_only=True)
    torch.save({k: v for k, v in data.items() if k not in ("optimizer_states",)}, weights_only)
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    cases = [("fit", plain, "is not a Lightning training checkpoint (it has no "
                            "'pytorch-lightning_version' or 'state_dict')"),
             ("test", plain, "is not a Lightning training checkpoint"),
             ("fit", inference, "is an inference checkpoint"),
             ("test", inference, "is an inference checkpoint"),
             ("fit", weights_only, "holds no training state to resume (no 'optimizer_states'")]
    for command, path, words in cases:
        assert main([command, "--config", str(cfg), "--ckpt_path", str(path)]) == 1
        (line,) = error_lines(capsys.readouterr().err)
        assert line.startswith(f"error: {path}: {words}"), line


# ------------------------------------------------------------------------------------------
# Explicit architecture flags


def test_an_architecture_flag_that_disagrees_with_the_checkpoint_is_one_line(
        shapes_dm_kwargs: dict, cache_dir: Path, run: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    # Row: `--model.net.hidden_dim 256` with a hidden-32 checkpoint ran at 32 without a word.
    last = run / "last.ckpt"
    cfg = config(tmp_path, shapes_dm_kwargs, cache_dir, tmp_path / "ckpt", max_epochs=3)
    for command in ("fit", "test"):
        args = [command, "--config", str(cfg), "--ckpt_path", str(last)]
        assert main([*args, "--model.net.hidden_dim", "256"]) == 2
        (line,) = error_lines(capsys.readouterr().err)
        assert "--model.net.hidden_dim 256 (the checkpoint has 32)" in line
        assert str(last) in line
    assert not (tmp_path / "config.yaml").exists()  # refused before the run
    # The same value, and decoding settings (which may differ), are accepted.
    assert main(["test", "--config", str(cfg), "--ckpt_path", str(last),
                 "--model.net.hidden_dim=32", "--model.decode.max_len", "4"]) == 0
