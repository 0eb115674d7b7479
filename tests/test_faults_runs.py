"""Faults around a run as a whole: two runs given one run folder, prefix-matched flags, bad
config values and disk errors, each a one-line error (no traceback) with nothing lost."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
from pathlib import Path

import pytest
from tiny_runs import REPO, cli_config, error_lines

from captioning.cli import main
from captioning.commands.errors import exit_status
from captioning.locks import FolderInUseError, claim_folder


def test_a_second_run_in_a_busy_run_folder_refuses(shapes_dm_kwargs: dict, cache_dir: Path,
                                                   tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """The folder is held by another process (a real one): the second run refuses in one line
    and writes nothing there; once the holder is gone, the folder can be used."""
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "run" / "ckpt")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom captioning.locks import claim_folder\n"
         "with claim_folder(sys.argv[1]):\n    print('held', flush=True)\n    time.sleep(60)",
         str(tmp_path / "run")], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert holder.stdout.readline().strip() == "held"
        assert main(["fit", "--config", str(cfg)]) == 1
        (line,) = error_lines(capsys.readouterr().err)
        assert f"{tmp_path / 'run'}: run folder in use by another run (pid {holder.pid})" in line
        assert not (tmp_path / "run" / "ckpt").exists()
    finally:
        holder.kill()
        holder.wait()
    assert main(["fit", "--config", str(cfg)]) == 0
    assert (tmp_path / "run" / "ckpt" / "last.ckpt").is_file()


def test_only_the_launchers_rank_zero_claims_the_run_folder(
        shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The other processes of a DDP run are the same run: they neither claim its folder nor set
    earlier checkpoints aside. Rank zero is read from every launcher's variables
    (`launcher_rank_zero`: NODE_RANK too, which Lightning's own rank before set-up ignores, so
    that another node's first process took itself for rank zero)."""
    import captioning.commands.lightning as lightning_command

    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "run" / "ckpt")
    monkeypatch.setattr(lightning_command, "launcher_rank_zero", lambda: False)
    with claim_folder(tmp_path / "run"):  # held: rank zero's claim would be refused
        assert main(["fit", "--config", str(cfg)]) == 0
    assert (tmp_path / "run" / "ckpt" / "last.ckpt").is_file()


def test_a_lock_file_gone_stale_on_nfs_is_opened_again(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On NFS, a process waiting on a lock file that its holder removed gets ESTALE: it opens
    the lock file anew and takes that, as where the file was replaced."""
    import fcntl

    from captioning import locks

    real, calls = fcntl.flock, []

    def stale_once(fd: int, op: int) -> None:
        calls.append(op)
        if len(calls) == 1:
            raise OSError(errno.ESTALE, os.strerror(errno.ESTALE))
        real(fd, op)

    monkeypatch.setattr(locks.fcntl, "flock", stale_once)
    with locks.exclusive_lock(tmp_path / "cache") as locked:
        assert locked and locks.lock_held(tmp_path / "cache")
    assert len(calls) == 3  # the stale try, the new file's lock, lock_held's probe


def test_claim_folder_is_released_after_the_block(tmp_path: Path) -> None:
    # a second holder, even in this process (another open file), is refused
    with claim_folder(tmp_path / "r"), pytest.raises(FolderInUseError), \
            claim_folder(tmp_path / "r"):
        pass
    with claim_folder(tmp_path / "r"):
        pass


@pytest.mark.parametrize(("flag", "message"), [
    (["--trainer.max_epoch", "2"], "unrecognized arguments: --trainer.max_epoch 2"),
    (["--model.net.hidden_dim", "-1"], "net.hidden_dim must be >= 1, got -1"),
    (["--model.net.dropout", "1.5"], "net.dropout must be in [0, 1), got 1.5"),
    (["--model.net.semi_sampling_prob", "2"], "net.semi_sampling_prob must be in [0, 1], got 2"),
    (["--model.decode.max_len", "0"], "decode.max_len must be >= 1, got 0"),
    (["--model.decoder_lr", "-1"], "model.decoder_lr must be in (0.0, inf), got -1.0"),
    (["--model.baseline_momentum", "1"], "model.baseline_momentum must be in [0.0, 1.0)"),
])
def test_bad_flags_and_values_are_one_line_before_any_work(
        flag: list[str], message: str, shapes_dm_kwargs: dict, cache_dir: Path, tmp_path: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    assert main(["fit", "--config", str(cfg), *flag]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert message in line
    assert not (tmp_path / "ckpt").exists()  # refused at construction, before any work


def test_data_root_that_is_a_file_is_one_line(shapes_dm_kwargs: dict, cache_dir: Path,
                                              tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    (tmp_path / "afile").write_text("not a dataset")
    assert main(["fit", "--config", str(cfg), "--data.source.root", str(tmp_path / "afile")]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert f"{tmp_path / 'afile'} exists and is not a directory" in line
    assert (tmp_path / "afile").read_text() == "not a dataset"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_disk_errors_are_one_line(code: int, capsys: pytest.CaptureFixture[str]) -> None:
    exc = OSError(code, "disk trouble", "/some/run/last.ckpt")
    assert exit_status(exc) == 1
    assert capsys.readouterr().err.count("\n") == 1
    assert exit_status(PermissionError(errno.EACCES, "denied", "/x")) == 1
    assert exit_status(OSError(errno.EBADF, "a bug")) is None  # not the user's: traceback


def test_an_image_in_two_splits_is_refused(tmp_path: Path, write_karpathy: object,
                                           write_png: object) -> None:
    """A Karpathy file that lists one image file in train and, under another id, in test."""
    from captioning.data.datamodule import CaptionDataModule
    from captioning.data.problems import DataError
    from captioning.data.sources import KarpathySplits

    for name in ("a.jpg", "b.jpg", "c.jpg"):
        write_png(tmp_path / "train2014" / name)  # type: ignore[operator]
    split_file = write_karpathy(tmp_path / "dataset_coco.json", [  # type: ignore[operator]
        {"id": 1, "filename": "a.jpg", "split": "train", "captions": ["a red square"]},
        {"id": 2, "filename": "b.jpg", "split": "val", "captions": ["a blue circle"]},
        {"id": 3, "filename": "c.jpg", "split": "train", "captions": ["a green star"]},
        {"id": 9, "filename": "a.jpg", "split": "test", "captions": ["a red square"]},
    ])
    dm = CaptionDataModule(source=KarpathySplits(split_file=str(split_file),
                                                 image_root=str(tmp_path)))
    with pytest.raises(DataError) as info:
        dm.records("test")
    text = str(info.value)
    assert "image id 9 (test)" in text and "also in the train split as image id 1" in text
    assert str(split_file) in text


def slow_command(module: str, name: str, says: str) -> str:
    """A `python -c` script that runs `captioning` with `module.name` replaced by a function
    that prints `says` and sleeps 10 minutes: the place a test sends its signal. A signal that
    is not handled at once shows as the test's hang guard running out, long before that."""
    return (f"import sys, time\nimport {module} as target\n"
            f"def slow(*args, **kwargs):\n    print({says!r}, flush=True)\n    time.sleep(600)\n"
            f"target.{name} = slow\nfrom captioning.cli import main\n"
            "sys.exit(main(sys.argv[1:]))\n")


SLOW_PREDICT = slow_command("captioning.data.predict", "model_input", "loading")


def test_sigterm_during_predict_is_one_line(tmp_path: Path, write_png: object) -> None:
    """SIGTERM while `captioning predict` loads images ends it like Ctrl-C: one line, exit 143,
    no traceback, no results file or shard left."""
    import signal

    from captioning.checkpoint import save_inference_checkpoint
    from captioning.models.captioner import Captioner, CaptionerConfig
    from captioning.vocab import Vocabulary

    vocab = Vocabulary.build([["a", "red", "square"]], min_count=1)
    net = CaptionerConfig(vocab_size=len(vocab), backbone="resnet18", weights=None, grid_size=2,
                          image_size=64, embed_dim=8, hidden_dim=8, attn_dim=8)
    ckpt = save_inference_checkpoint(tmp_path / "m.ckpt", Captioner(net), vocab)
    image = write_png(tmp_path / "a.png")  # type: ignore[operator]
    out = tmp_path / "out.json"
    proc = subprocess.Popen([sys.executable, "-c", SLOW_PREDICT, "predict", "--checkpoint",
                             str(ckpt), str(image), "--out", str(out), "--num-workers", "0",
                             "--accelerator", "cpu"], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "loading"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)  # a hang guard: it ends in about a second
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1] == "interrupted by SIGTERM"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.png", "m.ckpt"]


def test_a_test_run_sets_the_previous_results_aside(tmp_path: Path) -> None:
    """An earlier (or killed) test's files are renamed before a new pass writes its own: the
    files beside a run are its own, and nothing is deleted, however many passes ran before."""
    from captioning.evaluation import EvalResults, set_aside_results, write_results

    old = EvalResults(hypotheses={1: "old caption"}, metrics={"BLEU-4": 0.5})
    write_results(old, "test", tmp_path)
    moved = set_aside_results(tmp_path, "test")
    assert sorted(p.name for p in moved) == ["test_captions.previous.json",
                                             "test_metrics.previous.json"]
    assert not (tmp_path / "test_metrics.json").exists()
    assert "old caption" in (tmp_path / "test_captions.previous.json").read_text()
    assert set_aside_results(tmp_path, "test") == []  # nothing left to move
    # Later passes' files get the next free number, for both files alike: none is overwritten.
    for caption in ("second caption", "third caption"):
        write_results(EvalResults(hypotheses={1: caption}, metrics={}), "test", tmp_path)
        set_aside_results(tmp_path, "test")
    (tmp_path / "test_captions.previous-2.json").unlink()  # a user removed one file of a pass
    write_results(EvalResults(hypotheses={1: "fourth caption"}, metrics={}), "test", tmp_path)
    assert sorted(p.name for p in set_aside_results(tmp_path, "test")) == [
        "test_captions.previous-4.json", "test_metrics.previous-4.json"]
    for name in ("test_captions.previous-3.json", "test_metrics.previous-3.json"):
        (tmp_path / name).unlink()  # an earlier pass deleted: its number is not reused
    write_results(EvalResults(hypotheses={1: "fifth caption"}, metrics={}), "test", tmp_path)
    assert sorted(p.name for p in set_aside_results(tmp_path, "test")) == [
        "test_captions.previous-5.json", "test_metrics.previous-5.json"]
    texts = {p.name: p.read_text() for p in tmp_path.glob("test_captions.*.json")}
    assert {name: next(c for c in ("old", "second", "third", "fourth", "fifth") if c in text)
            for name, text in texts.items()} == {
        "test_captions.previous.json": "old", "test_captions.previous-4.json": "fourth",
        "test_captions.previous-5.json": "fifth"}


SLOW_SCORING = slow_command("captioning.metrics", "coco_scores", "scoring")


def test_sigterm_during_test_scoring_stops_it(shapes_dm_kwargs: dict, cache_dir: Path,
                                              tmp_path: Path, fitted: Path) -> None:
    """SIGTERM while the test pass is being scored (Java, minutes on COCO) stops it at once
    with one line and exit 143, instead of being ignored until scoring ends."""
    import signal

    cfg = cli_config(tmp_path / "a.yaml", shapes_dm_kwargs, cache_dir, tmp_path / "ckpt")
    proc = subprocess.Popen(
        [sys.executable, "-c", SLOW_SCORING, "test", "--config", str(cfg), "--ckpt_path",
         str(fitted), "--model.compute_metrics", "true", "--model.results_dir",
         str(tmp_path / "results")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True)
    while (line := proc.stdout.readline()) and line.strip() != "scoring":
        pass
    proc.send_signal(signal.SIGTERM)
    try:  # the stand-in scorer sleeps 600 s: a SIGTERM ignored until scoring ends times out
        _, err = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("SIGTERM did not stop the scoring")
    assert proc.returncode == 143, err[-2000:]
    assert "Traceback" not in err
    assert err.strip().splitlines()[-1].startswith("interrupted by SIGTERM")
    assert not (tmp_path / "results" / "test_metrics.json").exists()
