"""Checkpoint loading: identical decoding after reload, safe unpickling, clear errors.

`trained` (conftest; tests/trained.py) is a tiny captioner fitted for a few dozen steps through
a real Lightning Trainer on the session's shapes images, with a real checkpoint.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from trained import RunsCode, Trained

from captioning.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    LoadedModel,
    load_checkpoint,
    save_inference_checkpoint,
)
from captioning.models.captioner import DecodeConfig


def _edited(trained: Trained, tmp_path: Path, edit: Any) -> Path:
    """A copy of the trained checkpoint with `edit(dict)` applied."""
    data = torch.load(trained.checkpoint, map_location="cpu", weights_only=True)
    edit(data)
    path = tmp_path / "edited.ckpt"
    torch.save(data, path)
    return path


# -- reloading ----------------------------------------------------------------------------------
def test_reload_decodes_identically_to_the_in_memory_model(trained: Trained) -> None:
    loaded = load_checkpoint(trained.checkpoint)
    assert isinstance(loaded, LoadedModel)
    assert not loaded.captioner.training
    assert loaded.vocab == trained.vocab
    assert loaded.config == trained.module.net_config
    assert loaded.decode == DecodeConfig(strategy="beam", beam_size=3, max_len=12)
    images = trained.batch(trained.images)
    with torch.no_grad():
        want = trained.module.generate(images)
        got = loaded.captioner.generate(images, loaded.decode)
    assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    torch.testing.assert_close(got.scores, want.scores)
    torch.testing.assert_close(got.alphas, want.alphas)


def test_backbone_is_built_without_pretrained_weights(trained: Trained, tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # A config naming ImageNet weights must not trigger a download: the weights are in the file.
    def named(data: dict) -> None:
        data["captioning_model_config"]["weights"] = "IMAGENET1K_V1"

    path = _edited(trained, tmp_path, named)
    import captioning.models.encoder as encoder

    seen: list[Any] = []
    real = encoder.build_backbone
    monkeypatch.setattr(encoder, "build_backbone", lambda n, w: seen.append(w) or real(n, w))
    loaded = load_checkpoint(path)
    assert seen == [None]
    assert loaded.config.weights == "IMAGENET1K_V1"  # the training config is kept as stored


def test_inference_checkpoint_round_trip(trained: Trained, tmp_path: Path) -> None:
    loaded = load_checkpoint(trained.checkpoint)
    decode = DecodeConfig(beam_size=2, max_len=9)
    path = save_inference_checkpoint(tmp_path / "small" / "model.pt", loaded.captioner,
                                     loaded.vocab, decode)
    again = load_checkpoint(path)
    assert again.vocab == loaded.vocab and again.config == loaded.config
    assert again.decode == decode
    images = trained.batch(trained.images[:4])
    with torch.no_grad():
        a = loaded.captioner.generate(images, decode)
        b = again.captioner.generate(images, again.decode)
    assert torch.equal(a.tokens, b.tokens)
    assert path.stat().st_size < trained.checkpoint.stat().st_size  # no optimiser state


def test_a_failed_inference_save_keeps_the_old_file(trained: Trained, tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A disk that fills in the middle of the write leaves the old checkpoint, whole."""
    loaded = load_checkpoint(trained.checkpoint)
    path = save_inference_checkpoint(tmp_path / "model.pt", loaded.captioner, loaded.vocab)
    before = path.read_bytes()
    real = torch.save

    def half_then_full(obj: Any, f: Any) -> None:
        real(obj, f)
        with open(f, "r+b") as out:
            out.truncate(100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch, "save", half_then_full)
    with pytest.raises(OSError, match="No space"):
        save_inference_checkpoint(path, loaded.captioner, loaded.vocab, DecodeConfig(beam_size=5))
    assert path.read_bytes() == before and sorted(tmp_path.iterdir()) == [path]


def test_every_load_uses_weights_only(trained: Trained, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    real = torch.load

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return real(*args, **kwargs)

    monkeypatch.setattr(torch, "load", spy)
    load_checkpoint(trained.checkpoint)
    assert calls and all(c.get("weights_only") is True for c in calls)


# -- unsafe and broken files ----------------------------------------------------------------------
def test_malicious_checkpoint_is_refused_and_runs_nothing(trained: Trained,
                                                          tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    data = torch.load(trained.checkpoint, map_location="cpu", weights_only=True)
    data["extra"] = RunsCode(marker)
    evil = tmp_path / "evil.ckpt"
    torch.save(data, evil)
    with pytest.raises(CheckpointError, match="refused") as info:
        load_checkpoint(evil)
    assert str(evil) in str(info.value) and "exec" in str(info.value)
    assert not marker.exists()
    # Control: the payload is live, an unsafe load would have run it.
    control = tmp_path / "control"
    torch.save({"x": RunsCode(control)}, tmp_path / "control.ckpt")
    torch.load(tmp_path / "control.ckpt", weights_only=False)
    assert control.exists()


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.ckpt"
    with pytest.raises(CheckpointNotFoundError, match="does not exist") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)
    assert isinstance(info.value, FileNotFoundError) and isinstance(info.value, ValueError)
    with pytest.raises(CheckpointError, match="not a file"):
        load_checkpoint(tmp_path)


@pytest.mark.parametrize("content", [b"", b"hello, not a checkpoint\n", os.urandom(64)])
def test_not_a_checkpoint(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.ckpt"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match="not a readable PyTorch checkpoint"):
        load_checkpoint(path)


def test_missing_vocabulary(trained: Trained, tmp_path: Path) -> None:
    path = _edited(trained, tmp_path, lambda d: d.pop("captioning_vocab"))
    with pytest.raises(CheckpointError, match="no vocabulary") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


def test_vocabulary_size_mismatch(trained: Trained, tmp_path: Path) -> None:
    path = _edited(trained, tmp_path,
                   lambda d: d["captioning_vocab"]["words"].append("zebra"))
    with pytest.raises(CheckpointError, match="vocabulary size mismatch") as info:
        load_checkpoint(path)
    n = len(trained.vocab)
    assert f"vocabulary {n + 1}" in str(info.value) and f"embedding rows {n}" in str(info.value)


def test_config_vocab_size_mismatch(trained: Trained, tmp_path: Path) -> None:
    def edit(d: dict) -> None:
        d["captioning_model_config"]["vocab_size"] += 1

    with pytest.raises(CheckpointError, match="vocabulary size mismatch"):
        load_checkpoint(_edited(trained, tmp_path, edit))


def test_config_falls_back_to_hyperparameters_then_fails(trained: Trained,
                                                        tmp_path: Path) -> None:
    path = _edited(trained, tmp_path, lambda d: d.pop("captioning_model_config"))
    assert load_checkpoint(path).config == trained.module.net_config

    def no_config(d: dict) -> None:
        d.pop("captioning_model_config")
        d["hyper_parameters"].pop("net")

    with pytest.raises(CheckpointError, match="no model config"):
        load_checkpoint(_edited(trained, tmp_path, no_config))


def test_invalid_config_and_weights(trained: Trained, tmp_path: Path) -> None:
    def unknown_field(d: dict) -> None:
        d["captioning_model_config"]["colour"] = "red"

    with pytest.raises(CheckpointError, match="invalid model config"):
        load_checkpoint(_edited(trained, tmp_path, unknown_field))

    def bigger(d: dict) -> None:
        d["captioning_model_config"]["hidden_dim"] = 64

    with pytest.raises(CheckpointError, match="weights do not fit"):
        load_checkpoint(_edited(trained, tmp_path, bigger))

    def missing_key(d: dict) -> None:
        d["state_dict"].pop("captioner.decoder.gate.weight")

    with pytest.raises(CheckpointError, match="weights do not fit"):
        load_checkpoint(_edited(trained, tmp_path, missing_key))

    with pytest.raises(CheckpointError, match=r"no 'captioner\.' weights"):
        load_checkpoint(_edited(trained, tmp_path, lambda d: d.update(state_dict={})))


def test_the_lightning_module_writes_the_checkpoint_keys(trained: Trained) -> None:
    import captioning.checkpoint as ck

    data = torch.load(trained.checkpoint, map_location="cpu", weights_only=True)
    for key in (ck.CHECKPOINT_VOCAB_KEY, ck.CHECKPOINT_CONFIG_KEY, ck.CHECKPOINT_RNG_KEY):
        assert key in data
    assert data["hyper_parameters"]["decode"] == DecodeConfig(beam_size=3, max_len=12).to_dict()
    assert not any(k in data["hyper_parameters"] for k in ck.LEGACY_DECODE_KEYS)


def test_a_flipped_bit_in_a_tensor_is_refused(trained: Trained, tmp_path: Path) -> None:
    """torch.load does not check the zip entries' CRC-32s: a damaged weight would load."""
    import zipfile

    from captioning.checkpoint import CheckpointError, check_checkpoint_file

    path = tmp_path / "flipped.ckpt"
    path.write_bytes(trained.checkpoint.read_bytes())
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(path, "r+b") as f:  # the entry's bytes start after its local header
        f.seek(info.header_offset + 26)
        name_len, extra_len = (int.from_bytes(f.read(2), "little") for _ in range(2))
        f.seek(info.header_offset + 30 + name_len + extra_len + info.file_size // 2)
        byte = f.read(1)[0]
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte ^ 0x10]))
    torch.load(path, weights_only=True)  # torch itself reads it without complaint
    for load in (load_checkpoint, functools.partial(check_checkpoint_file, resume=True)):
        with pytest.raises(CheckpointError, match=rf"{path}: corrupt checkpoint: the bytes of "
                                                  rf"\S+{info.filename.split('/')[-1]} do not"):
            load(path)
    load_checkpoint(trained.checkpoint)  # the intact file still loads


def test_a_checkpoint_saved_without_checksums_loads(trained: Trained, tmp_path: Path) -> None:
    """torch can write zip entries with a CRC of 0 (no checksum): nothing to check there."""
    data = torch.load(trained.checkpoint, weights_only=True)
    path = tmp_path / "no_crc.ckpt"
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(data, path)
    finally:
        torch.serialization.set_crc32_options(True)
    import zipfile

    with zipfile.ZipFile(path) as z:
        assert any(i.CRC == 0 and i.file_size > 0 for i in z.infolist())
    got, want = load_checkpoint(path), load_checkpoint(trained.checkpoint)
    assert got.vocab == want.vocab
    for (name, a), b in zip(got.captioner.state_dict().items(),
                            want.captioner.state_dict().values()):
        assert torch.equal(a, b), name


def test_each_ddp_rank_resumes_its_own_random_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under DDP a checkpoint holds every rank's streams ("ranks", in rank order) beside rank
    zero's own; a resume of as many ranks takes its own, any other resume rank zero's (as an
    older checkpoint holds only those)."""
    import captioning.rng_state as rng

    assert "ranks" not in rng.saved_rng_states()  # one process: its own, as before
    torch.manual_seed(5)
    other = rng.rng_states()  # "rank one's"
    torch.manual_seed(4)
    monkeypatch.setattr(rng, "world_size", lambda: 2)
    monkeypatch.setattr(rng, "all_gather_objects", lambda own: [own, other])
    saved = rng.saved_rng_states()
    mine = torch.rand(3)  # rank zero's next draws
    rng.restore_rng_states(saved, rank=1, world=2)
    assert torch.equal(torch.get_rng_state(), other["torch"])
    rng.restore_rng_states(saved, rank=1, world=4)  # another number of ranks: rank zero's
    assert torch.equal(torch.rand(3), mine)
    rng.restore_rng_states({k: v for k, v in saved.items() if k != "ranks"}, rank=1, world=2)
    assert torch.equal(torch.rand(3), mine)
