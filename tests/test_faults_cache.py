"""Faults of the feature cache, of two runs on one fresh shapes folder, and SIGTERM during the
cache build and shapes generation (issue 14). Each test injects the fault the way the
fault-injection pass did, at a tiny size, and checks the outcome (an automatic rebuild, one
line naming the file, or a wait) and that the earlier good state is intact."""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from tiny_runs import REPO, cli_config, error_lines, tiny_encoder
from torch.utils.data import DataLoader

from captioning.commands.errors import exit_status
from captioning.data.datasets import CachedInputs
from captioning.data.features import CacheError, FeatureCache, keys_digest, npy_header
from captioning.data.transforms import build_image_transform

S = 64
KEY = {"backbone": "resnet18"}
WAIT = 120.0  # seconds a subprocess may take to reach the point of the fault (a busy machine)

# A child that builds the cache of the train images under argv[1] in argv[2], `argv[3]`
# seconds per batch; `argv[4]`, when given, is a file-size limit (bytes) set before building.
BUILD_CHILD = """
import resource, signal, sys, time
from pathlib import Path
import torch
from captioning.commands.errors import exit_status
from captioning.data.features import FeatureCache
from captioning.data.transforms import build_image_transform
from captioning.models.encoder import CNNEncoder
torch.manual_seed(0)
encoder = CNNEncoder(backbone="resnet18", weights=None, grid_size=2)
forward = encoder.forward
def slow(x):
    time.sleep(float(sys.argv[3]))
    return forward(x)
encoder.forward = slow
paths = sorted(Path(sys.argv[1]).glob("train_*.png"))[:12]
if len(sys.argv) > 4:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[4]), int(sys.argv[4])))
try:
    FeatureCache.build(cache_dir=sys.argv[2], encoder=encoder, encoder_config={"backbone":
        "resnet18"}, image_size=64, paths=paths, transform=build_image_transform(64),
        batch_size=4, device="cpu", progress=False)
except BaseException as e:
    status = exit_status(e)  # what `captioning` does with it
    if status is None:
        raise
    sys.exit(status)
"""

# Generates a shapes dataset at argv[1] once told to on stdin, then builds its feature cache;
# prints the inodes of the dataset folder and of the cache. With argv[2] == "hold" it stops at
# its first PNG (the dataset lock held), prints "holding" and goes on once stdin says so.
RACE_CHILD = """
import logging, os, sys, threading
from pathlib import Path
import torch
from PIL import Image
from captioning.data.features import FeatureCache
from captioning.data.shapes import generate_shapes
from captioning.data.transforms import build_image_transform
from captioning.models.encoder import CNNEncoder
logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
save, first = Image.Image.save, threading.Lock()
held = sys.argv[2] != "hold"
def holding_save(self, *args, **kwargs):
    global held
    with first:  # other saving threads wait here until the test releases the first
        if not held:
            held = True
            print("holding", flush=True)
            sys.stdin.readline()
    return save(self, *args, **kwargs)
Image.Image.save = holding_save
print("ready", flush=True)
sys.stdin.readline()
root = generate_shapes(sys.argv[1], num_train=8, num_val=2, num_test=2, image_size=32)
torch.manual_seed(0)
encoder = CNNEncoder(backbone="resnet18", weights=None, grid_size=2)
images = sorted((root / "images").glob("*.png"))
cache = FeatureCache.build(cache_dir=root / "features", encoder=encoder,
    encoder_config={"backbone": "resnet18"}, image_size=32, paths=images,
    transform=build_image_transform(32), batch_size=4, device="cpu", progress=False)
assert len(cache) == 12 and all(cache[p].shape == (4, 512) for p in images)
print(os.stat(root).st_ino, os.stat(cache.array_path).st_ino, flush=True)
"""

SHAPES_CHILD = """
import sys, time
from PIL import Image
save = Image.Image.save
def slow_save(self, *args, **kwargs):
    time.sleep(0.05)
    return save(self, *args, **kwargs)
Image.Image.save = slow_save
from captioning.cli import main
sys.exit(main(["shapes", "--root", sys.argv[1], "--num-train", "400", "--num-val", "0",
               "--num-test", "0", "--image-size", "32"]))
"""

CACHE_FEATURES_CHILD = """
import sys, time
from captioning.models.encoder import CNNEncoder
forward = CNNEncoder.forward
def slow(self, x):  # long enough that the signal always comes during the first batch
    time.sleep(5)
    return forward(self, x)
CNNEncoder.forward = slow
from captioning.cli import main
sys.exit(main(["cache-features", "--config", sys.argv[1]]))
"""


def _build(cache_dir: Path, images: list[Path], *, verify: str = "full") -> FeatureCache:
    return FeatureCache.build(
        cache_dir=cache_dir, encoder=tiny_encoder(), encoder_config=KEY, image_size=S,
        paths=images, transform=build_image_transform(S), batch_size=8, device="cpu",
        progress=False, verify=verify)


@pytest.fixture(scope="module")
def images(shapes_root: Path) -> list[Path]:
    return sorted((shapes_root / "images").glob("train_*.png"))


@pytest.fixture(scope="module")
def good(images: list[Path], tmp_path_factory: pytest.TempPathFactory
         ) -> tuple[Path, np.ndarray]:
    """A good cache of the 24 train images (array path) and its grids."""
    cache = _build(tmp_path_factory.mktemp("good"), images)
    return cache.array_path, np.array(cache.array)


@pytest.fixture
def built(good: tuple[Path, np.ndarray], tmp_path: Path) -> Path:
    """A copy of the good cache in a fresh folder; its array path."""
    out = tmp_path / "features"
    out.mkdir()
    for suffix in (".npy", ".json"):
        target = out / good[0].with_suffix(suffix).name
        target.write_bytes(good[0].with_suffix(suffix).read_bytes())
    return out / good[0].name


def _leftovers(folder: Path) -> list[str]:
    """Temporary and lock files in `folder`."""
    return sorted(p.name for p in folder.iterdir() if p.name.endswith((".tmp", ".lock")))


def _overwrite(path: Path, at: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(npy_header(path)[2] + at)
        f.write(data)


def _edit_index(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    index = path.with_suffix(".json")
    meta = json.loads(index.read_text())
    edit(meta)
    index.write_text(json.dumps(meta))


def _rotate(meta: dict[str, Any], *, rehash: bool) -> None:
    meta["paths"] = meta["paths"][1:] + meta["paths"][:1]
    if rehash:
        meta["paths_hash"] = keys_digest(meta["paths"])


FAULTS: dict[str, tuple[Callable[[Path], None], str]] = {
    # row: (how the fault was injected, what the one line says)
    "truncated_npy": (lambda p: os.truncate(p, p.stat().st_size // 2), "bytes on disk"),
    "wrong_sized_array": (lambda p: np.save(p, np.zeros((23, 4, 512), np.float16)),
                          "bytes on disk"),
    "zeroed_32KiB_block": (lambda p: _overwrite(p, 16384, bytes(32768)), "differ from"),
    "index_paths_rotated": (lambda p: _edit_index(p, lambda m: _rotate(m, rehash=False)),
                            "image keys do not match their hash"),
    "index_paths_rotated_and_rehashed": (
        lambda p: _edit_index(p, lambda m: _rotate(m, rehash=True)),
        "not the records' images in order"),
    "index_blocks_emptied": (lambda p: _edit_index(p, lambda m: m.update(blocks=[])),
                             "block hashes do not cover"),
    "index_block_added": (lambda p: _edit_index(p, lambda m: m["blocks"].append("0" * 32)),
                          "block hashes do not cover"),
    "random_4KiB": (lambda p: _overwrite(p, 40000, np.random.default_rng(0).bytes(4096)),
                    "differ from"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_a_damaged_cache_is_named_in_one_line_and_rebuilt(
        fault: str, built: Path, images: list[Path], good: tuple[Path, np.ndarray],
        caplog: pytest.LogCaptureFixture, signal_handlers_restored: None) -> None:
    damage, says = FAULTS[fault]
    damage(built)
    with pytest.raises(CacheError) as caught:
        FeatureCache.open(built.parent, built.stem, paths=[str(p) for p in images])
    line = str(caught.value)
    assert "\n" not in line and str(built) in line and says in line
    with caplog.at_level(logging.WARNING, logger="captioning.data.features"):
        cache = _build(built.parent, images)  # a later run: rebuilt with a warning
    assert [r.getMessage() for r in caplog.records] == [f"{line}; rebuilding it"]
    assert cache.array_path == built
    np.testing.assert_array_equal(np.array(cache.array), good[1])  # the good grids again
    assert FeatureCache.open(built.parent, built.stem, verify="full") is not None
    assert _leftovers(built.parent) == []


def test_an_index_without_its_blocks_fails_in_lazy_mode_too(
        built: Path, images: list[Path], signal_handlers_restored: None) -> None:
    _edit_index(built, lambda m: m.update(blocks=[]))
    with pytest.raises(CacheError, match="block hashes do not cover"):
        FeatureCache.open(built.parent, built.stem, verify="lazy")
    built.with_suffix(".json").write_text("[" * 100_000)  # too deep for the JSON parser
    with pytest.raises(CacheError, match=r"\.json: unreadable"):
        FeatureCache.open(built.parent, built.stem, verify="lazy")


def test_a_damaged_block_in_lazy_mode_stops_at_its_first_read(
        tmp_path: Path, images: list[Path], good: tuple[Path, np.ndarray],
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("captioning.data.features.BLOCK_BYTES", 16384)  # blocks of 4 rows
    array = _build(tmp_path, images).array_path
    FAULTS["zeroed_32KiB_block"][0](array)  # rows 4 to 11: blocks 1 and 2
    cache = _build(tmp_path, images, verify="lazy")  # opens: sizes and header agree
    batches = iter(DataLoader(CachedInputs(cache, images), batch_size=4, num_workers=1))
    np.testing.assert_array_equal(next(batches).numpy(), good[1][:4])  # a good block
    with pytest.raises(CacheError) as caught:
        next(batches)  # never serves a row of a bad block
    line = str(caught.value)
    assert "\n" not in line and str(array) in line and "rows 4-7 differ" in line
    assert not array.with_suffix(".json").exists()  # so that the next run rebuilds it
    rebuilt = _build(tmp_path, images, verify="lazy")
    got = torch.cat(list(DataLoader(CachedInputs(rebuilt, images), batch_size=4,
                                    num_workers=1)))
    np.testing.assert_array_equal(got.numpy(), good[1])
    assert _leftovers(tmp_path) == []


def _child(script: str, *args: str, **kwargs: Any) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", script, *args], cwd=REPO, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kwargs)


def _wait_for(found: Callable[[], list[Path]], child: subprocess.Popen[str]) -> list[Path]:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        hits = found()
        if hits:
            return hits
        if child.poll() is not None:
            pytest.fail(f"the child ended early ({child.returncode}): {child.stderr.read()}")
        time.sleep(0.02)
    child.kill()
    pytest.fail("the child never got there")


def test_a_file_size_limit_during_the_build_is_one_line(
        built: Path, shapes_root: Path, good: tuple[Path, np.ndarray]) -> None:
    folder = built.parent  # holds a good cache of other images
    child = _child(BUILD_CHILD, str(shapes_root / "images"), str(folder), "0", "16384")
    _, err = child.communicate(timeout=WAIT)
    assert child.returncode == 1, err
    [line] = error_lines(err)
    assert f"49,280 bytes needed in {folder} (File too large" in line  # 12 grids + header
    assert _leftovers(folder) == [] and sorted(p.name for p in folder.iterdir()) == \
        sorted([built.name, built.with_suffix(".json").name])
    cache = FeatureCache.open(folder, built.stem, verify="full")  # intact
    assert cache is not None
    np.testing.assert_array_equal(np.array(cache.array), good[1])


def test_a_full_disk_during_the_build_is_one_line(
        tmp_path: Path, images: list[Path], monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    """The disk fills up where the cache reserves its file (`posix_fallocate`, before any grid
    is written): one line with the bytes needed, nothing half-written, the folder intact."""
    folder = tmp_path / "features"
    folder.mkdir()
    (folder / "keep.txt").write_text("earlier good state\n")
    calls: list[tuple[str, int]] = []

    def full(fd: int, offset: int, length: int) -> None:
        calls.append((os.readlink(f"/proc/self/fd/{fd}"), length))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(CacheError) as caught:
        _build(folder, images)  # 24 grids of 4 × 512 float16 (98,304 bytes) + 128 of header
    [(reserved, length)] = calls  # the fault hit the cache's own temporary file
    assert Path(reserved).parent == folder and reserved.endswith(".tmp") and length == 98_432
    assert exit_status(caught.value) == 1
    [line] = error_lines(capsys.readouterr().err)
    assert f"98,432 bytes needed in {folder}" in line and "No space left on device" in line
    assert sorted(p.name for p in folder.iterdir()) == ["keep.txt"]  # nothing half-written
    assert (folder / "keep.txt").read_text() == "earlier good state\n"


def test_kill_9_during_the_build_leaves_a_temporary_the_next_build_removes(
        tmp_path: Path, shapes_root: Path, images: list[Path]) -> None:
    folder = tmp_path / "features"
    # 5 s a batch: the kill always comes while the first batch runs, however busy the machine
    child = _child(BUILD_CHILD, str(shapes_root / "images"), str(folder), "5")
    [temp] = _wait_for(lambda: list(folder.glob(".*.tmp")) if folder.is_dir() else [], child)
    os.kill(child.pid, signal.SIGKILL)
    child.communicate(timeout=WAIT)
    assert f".{child.pid}." in temp.name and temp.exists()  # what kill -9 leaves
    cache = _build(folder, images[:12])  # the next run: same cache, lock free again
    assert not temp.exists() and _leftovers(folder) == []
    assert FeatureCache.open(folder, cache.array_path.stem, verify="full") is not None


def test_cache_files_respect_the_umask(tmp_path: Path, images: list[Path]) -> None:
    old = os.umask(0o002)
    try:
        cache = _build(tmp_path, images[:4])
    finally:
        os.umask(old)
    for path in (cache.array_path, cache.array_path.with_suffix(".json")):
        assert path.stat().st_mode & 0o777 == 0o664  # mkstemp gave 0600


def test_cache_features_verify_and_prune(shapes_dm_kwargs: dict, tmp_path: Path,
                                         caplog: pytest.LogCaptureFixture) -> None:
    from captioning.cli import main

    folder = tmp_path / "features"
    cfg = str(cli_config(tmp_path / "config.yaml", shapes_dm_kwargs, folder, tmp_path / "ckpt"))
    assert main(["cache-features", "--config", cfg]) == 0
    current = sorted(p.name for p in folder.iterdir())
    assert len(current) == 6  # train, val and test: array and index each
    old = folder / current[0]
    superseded = [folder / f"0123456789abcdef0123{s}" for s in (".npy", ".json")]
    for p, src in zip(superseded, (old.with_suffix(".npy"), old.with_suffix(".json"))):
        p.write_bytes(src.read_bytes())
    junk = [folder / "tmpk3j2_x.npy.tmp", folder / ".fedcba9876543210fedc.npy.999999999.0123abcd.tmp",
            folder / "0123456789abcdef0123.npy.lock", folder / "fedcba9876543210fedc.npy"]
    for p in junk:
        p.write_bytes(b"x" * 10)
    caplog.set_level(logging.INFO, logger="captioning.commands.cache_features")
    before = sorted(p.name for p in folder.iterdir())
    assert main(["cache-features", "--config", cfg, "--prune", "--dry-run"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == before  # nothing deleted
    would = [r.getMessage() for r in caplog.records if r.getMessage().startswith("would delete")]
    assert len(would) == 6 and f"dry run, nothing deleted in {folder}: " in caplog.text
    caplog.clear()
    assert main(["cache-features", "--config", cfg, "--prune"]) == 0
    assert sorted(p.name for p in folder.iterdir()) == current
    deleted = [r.getMessage() for r in caplog.records if r.getMessage().startswith("deleted")]
    assert len(deleted) == 6 and f"pruned {folder}: " in caplog.text

    caplog.clear()
    assert main(["cache-features", "--config", cfg, "--verify"]) == 0
    assert caplog.text.count(": ok: ") == 3
    train = next(p for p in folder.glob("*.npy") if json.loads(p.with_suffix(".json").read_text(
        ))["paths"][0].endswith("train_00000.png"))
    _overwrite(train, 1000, np.random.default_rng(1).bytes(4096))
    caplog.clear()
    assert main(["cache-features", "--config", cfg, "--verify"]) == 1
    [bad] = [r.getMessage() for r in caplog.records if ": bad: " in r.getMessage()]
    assert bad.startswith(f"train: bad: feature cache {train}: 1 of ") and "\n" not in bad


def test_prune_deletes_only_the_caches_own_files(tmp_path: Path) -> None:
    from captioning.commands.cache_features import prunable

    others = ["dataset_shapes.json", "vocab.json", "notes.npy", "abc.json.lock",
              ".vocab.json.999999999.0123abcd.tmp", "0123456789abcdef012.npy"]
    for name in others:
        (tmp_path / name).write_text("{}")
    cache = ["0123456789abcdef0123.npy", "0123456789abcdef0123.json",
             "0123456789abcdef0123.npy.lock",
             ".0123456789abcdef0123.json.999999999.0123abcd.tmp"]
    for name in cache:
        (tmp_path / name).write_text("{}")
    assert sorted(p.name for p in prunable(tmp_path, set())) == sorted(cache)


def test_two_runs_on_a_fresh_shapes_folder_share_one_dataset_and_cache(tmp_path: Path) -> None:
    """The first run holds the dataset lock (stopped at its first PNG) until the second is
    seen waiting for it; then both finish with the one dataset and the one cache."""
    root = tmp_path / "shapes"
    first, second = (_child(RACE_CHILD, str(root), how, stdin=subprocess.PIPE)
                     for how in ("hold", "free"))
    try:
        for child in (first, second):
            assert child.stdout.readline().strip() == "ready"
        first.stdin.write("go\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "holding"  # generating, the lock held
        assert list(tmp_path.glob("shapes.lock"))
        second.stdin.write("go\n")
        second.stdin.close()
        err_lines: list[str] = []

        def read_err() -> None:
            for ln in second.stderr:
                err_lines.append(ln)

        reader = threading.Thread(target=read_err, daemon=True)
        reader.start()
        waiting = f"waiting for the shapes dataset {root} (held by pid {first.pid})"
        _wait_for(lambda: [ln for ln in list(err_lines) if waiting in ln], second)
        out_a, err_a = first.communicate("release\n", timeout=WAIT)
        second.wait(timeout=WAIT)
        reader.join(timeout=WAIT)
        out_b, err_b = second.stdout.read(), "".join(err_lines)
    finally:
        for child in (first, second):
            if child.poll() is None:
                child.kill()
                child.communicate()
    assert [first.returncode, second.returncode] == [0, 0], (err_a, err_b)
    assert out_a.split()[-2:] == out_b.split()[-2:]  # one dataset folder, one cache file
    assert "generating shapes dataset" in err_a and "generating shapes dataset" not in err_b
    assert "shapes dataset generated by another process" in err_b
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shapes"]  # no temporaries, locks
    assert len(list((root / "features").glob("*.npy"))) == 1
    assert _leftovers(root / "features") == []


def _assert_one_line_143(child: subprocess.Popen[str]) -> None:
    _, err = child.communicate(timeout=WAIT)
    assert child.returncode == 143, err
    assert "Traceback" not in err and err.count("interrupted by SIGTERM") == 1
    assert err.rstrip().splitlines()[-1] == "interrupted by SIGTERM"


def test_sigterm_during_shapes_generation_cleans_up(tmp_path: Path) -> None:
    child = _child(SHAPES_CHILD, str(tmp_path / "shapes"))
    _wait_for(lambda: list(tmp_path.glob(".shapes.*.tmp/images/*.png")), child)
    os.kill(child.pid, signal.SIGTERM)
    _assert_one_line_143(child)
    assert list(tmp_path.iterdir()) == []  # no dataset, temporary folder or lock


def test_sigterm_during_cache_features_cleans_up(shapes_dm_kwargs: dict, tmp_path: Path
                                                 ) -> None:
    folder = tmp_path / "features"
    cfg = cli_config(tmp_path / "config.yaml", shapes_dm_kwargs, folder, tmp_path / "ckpt")
    child = _child(CACHE_FEATURES_CHILD, str(cfg))
    _wait_for(lambda: list(folder.glob(".*.npy.*.tmp")) if folder.is_dir() else [], child)
    os.kill(child.pid, signal.SIGTERM)
    _assert_one_line_143(child)
    assert list(folder.iterdir()) == []  # no temporary, lock or half-built cache
