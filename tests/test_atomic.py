"""The one atomic writer: a failed or killed write leaves the old file and no partial one;
temporaries of dead writers are removed; files get the umask's permissions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import needs_java

from captioning.atomic import (
    HOST,
    STALE_ELSEWHERE_S,
    TEMP_RE,
    remove_stale_temporaries,
    temporary_name,
    write_atomic,
    write_text_atomic,
)


def test_a_failed_write_keeps_the_old_file(tmp_path: Path) -> None:
    target = write_text_atomic(tmp_path / "a.json", "old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        write_atomic(target, fail)
    assert target.read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json"]


def test_a_killed_writer_leaves_a_temporary_the_next_run_removes(tmp_path: Path) -> None:
    """kill -9 in the middle of a write: the target is untouched, and the dead writer's
    temporary (its PID in the name) is removed; a live writer's is left alone."""
    target = write_text_atomic(tmp_path / "png", "old")
    child = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom captioning.atomic import write_atomic\n"
         "def slow(tmp):\n    tmp.write_text('half'); print('writing', flush=True); "
         "time.sleep(60)\nwrite_atomic(sys.argv[1], slow)", str(target)],
        stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "writing"
    child.kill()
    child.wait()
    left = [p for p in tmp_path.iterdir() if p != target]
    assert len(left) == 1 and TEMP_RE.match(left[0].name)
    live = temporary_name(target)
    live.write_text("mine")
    assert remove_stale_temporaries(tmp_path, pattern=".*.tmp") == left
    assert target.read_text() == "old" and live.exists()


def test_another_machines_temporary_is_stale_only_once_untouched_for_a_day(
        tmp_path: Path) -> None:
    """On a shared file system a PID from another machine says nothing here: that machine's
    live write is left alone, and only a temporary nobody has written for a day is removed.
    Names written before machines were in them count as this machine's."""
    elsewhere = "0" * 8 if HOST != "0" * 8 else "1" * 8
    dead_pid = 999_999_999  # above any pid_max: no such process here
    live = tmp_path / f".a.npy.{elsewhere}.{os.getpid() + 1}.0123abcd.tmp"
    old = tmp_path / f".b.npy.{elsewhere}.{dead_pid}.0123abcd.tmp"
    unnamed = tmp_path / f".c.npy.{dead_pid}.0123abcd.tmp"  # the older form: no machine
    mine = tmp_path / f".d.npy.{HOST}.{dead_pid}.0123abcd.tmp"
    for p in (live, old, unnamed, mine):
        p.write_text("x")
    long_ago = old.stat().st_mtime - STALE_ELSEWHERE_S - 60
    os.utime(old, (long_ago, long_ago))
    assert TEMP_RE.match(live.name)["host"] == elsewhere
    assert remove_stale_temporaries(tmp_path) == [old, unnamed, mine]
    assert live.exists()


def test_files_get_the_umask_permissions(tmp_path: Path) -> None:
    old = os.umask(0o002)
    try:
        target = write_text_atomic(tmp_path / "shared.json", "{}")
    finally:
        os.umask(old)
    assert target.stat().st_mode & 0o777 == 0o664


@needs_java
def test_the_ptb_tokenizer_writes_its_input_outside_site_packages(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """pycocoevalcap's own tokenizer writes its input beside its jar (a killed run leaves it in
    site-packages); ours writes it in $TMPDIR and removes it."""
    import pycocoevalcap.tokenizer.ptbtokenizer as ptb

    from captioning.metrics import coco_scores

    real, seen = subprocess.run, []

    def spy(cmd: list[str], *args: object, **kwargs: object) -> object:
        seen.append(Path(cmd[-1]))
        return real(cmd, *args, **kwargs)

    monkeypatch.setattr(subprocess, "run", spy)
    folder = Path(ptb.__file__).parent
    before = set(folder.iterdir())
    scores = coco_scores({1: ["a red square"], 2: ["a blue circle"]},
                         {1: "a red square", 2: "a circle"})
    assert scores["BLEU-1"] > 0
    assert seen and all(folder not in p.parents and not p.exists() for p in seen)
    assert set(folder.iterdir()) == before
