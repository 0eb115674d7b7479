"""Frozen-encoder feature cache: keys, rebuilds, lazy memmaps, workers, the CNN never runs,
`captioning cache-features`, and bf16 autocast / torch.compile plumbing."""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from typing import Any

import lightning.pytorch as L
import numpy as np
import pytest
import torch
from PIL import Image
from tiny_runs import tiny_encoder
from torch.utils.data import DataLoader

from captioning.data import device_grids
from captioning.data.cache_names import CACHE_NAME_RE, cache_files, cache_identity
from captioning.data.datamodule import CaptionDataModule
from captioning.data.datasets import CachedInputs
from captioning.data.features import CacheError, FeatureCache
from captioning.data.serving import attach_feature_cache
from captioning.data.transforms import build_image_transform
from captioning.lit_module import CaptioningModule
from captioning.models.captioner import CaptionerConfig, DecodeConfig
from captioning.models.encoder import CNNEncoder

S = 64  # image size of the session's shapes dataset


class _Forbidden(RuntimeError):
    pass


def _build(cache_dir: Path, encoder: torch.nn.Module, paths: list[Path], *,
           image_size: int = S, key: dict[str, Any] | None = None,
           progress: bool = False) -> FeatureCache:
    return FeatureCache.build(
        cache_dir=cache_dir, encoder=encoder, encoder_config=key or {"backbone": "resnet18"},
        image_size=image_size, paths=paths, transform=build_image_transform(image_size),
        batch_size=4, device="cpu", progress=progress)


def _forbid(encoder: torch.nn.Module, monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(*args: Any, **kwargs: Any) -> Any:
        raise _Forbidden("the CNN ran")

    monkeypatch.setattr(encoder, "forward", boom)


def test_same_inputs_hit_the_cache(copied_images: list[Path], tmp_path: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    enc = tiny_encoder()
    first = _build(tmp_path / "f", enc, copied_images)
    assert first.array.dtype == np.float16 and first.array.shape[0] == len(copied_images)
    _forbid(enc, monkeypatch)
    again = _build(tmp_path / "f", enc, copied_images)  # a hit: the encoder is not called
    assert again.array_path == first.array_path
    ref = CNNEncoder.forward(enc, build_image_transform(S)(
        Image.open(copied_images[2]).convert("RGB"))[None])  # the real forward, bypassing the patch
    grid = again[copied_images[2]]
    assert grid.dtype == torch.float16  # stays float16 until the module casts it on the device
    torch.testing.assert_close(grid.float(), ref[0], atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(again[str(copied_images[2])], grid)  # same row by str or Path


def test_a_cached_jpeg_grid_is_the_one_caption_and_training_compute(tmp_path: Path) -> None:
    """A JPEG far larger than the image size is decoded at a reduced scale by training,
    `caption` and `predict` (`load_image(min_side=...)`); the cache decodes it the same way,
    so a model trained on cached grids is captioned on the same pixels."""
    from captioning.data.images import load_image

    rng = np.random.default_rng(0)
    path = tmp_path / "big.jpg"
    Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8)).save(path, quality=90)
    assert load_image(path, min_side=S).size == (160, 120)  # the reduced decode: 1/4 scale
    enc = tiny_encoder()
    cache = _build(tmp_path / "f", enc, [path])
    transform = build_image_transform(S)
    with torch.no_grad():
        reduced, full = (enc(transform(im)[None])[0] for im in (
            load_image(path, min_side=S), load_image(path)))
    assert (reduced - full).abs().max() > 1e-2  # the two decodes do differ at this size
    torch.testing.assert_close(cache[path].float(), reduced, atol=2e-3, rtol=2e-3)


def test_building_shows_a_progress_bar(copied_images: list[Path], tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    _build(tmp_path / "f", tiny_encoder(), copied_images, progress=True)
    err = capsys.readouterr().err
    assert "caching encoder features" in err and f"{len(copied_images)}/{len(copied_images)}" in err
    _build(tmp_path / "f", tiny_encoder(), copied_images, progress=True)  # a hit: nothing to show
    assert "caching encoder features" not in capsys.readouterr().err


def test_captioner_casts_float16_grids_for_every_consumer() -> None:
    from captioning.models import Captioner, DecodeConfig

    captioner = Captioner(CaptionerConfig(vocab_size=8, backbone="resnet18", embed_dim=8,
                                          hidden_dim=8, attn_dim=8)).eval()
    grids = torch.randn(2, 4, 512).half()
    out = captioner.encode(grids)
    assert out.dtype == torch.float32 and torch.equal(out, grids.float())
    assert captioner.encode(grids, keep_half=True) is grids  # the teacher-forced pass's
    features = torch.randn(2, 4, 512)
    assert captioner.encode(features) is features
    with torch.no_grad():  # decoding cached grids directly (beam benchmark, predict) works
        a = captioner.generate(grids, DecodeConfig(beam_size=2, max_len=3))
        b = captioner.generate(grids.float(), DecodeConfig(beam_size=2, max_len=3))
    assert torch.equal(a.tokens, b.tokens)


@pytest.mark.parametrize("change", ["image_file", "image_size", "encoder_config"])
def test_rebuilds_when_an_input_changes(copied_images: list[Path], tmp_path: Path,
                                        change: str) -> None:
    enc = tiny_encoder()
    key = {"backbone": "resnet18", "weights": "a"}
    first = _build(tmp_path / "f", enc, copied_images, key=key)
    size = S
    if change == "image_file":
        Image.new("RGB", (S, S), (10, 200, 10)).save(copied_images[3])
        st = copied_images[3].stat()
        os.utime(copied_images[3], ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000))
    elif change == "image_size":
        size = 32
    else:
        key = {**key, "weights": "b"}  # e.g. another weights fingerprint
    second = _build(tmp_path / "f", enc, copied_images, image_size=size, key=key)
    assert second.array_path != first.array_path
    assert len(list((tmp_path / "f").glob("*.npy"))) == 2
    if change == "image_file":  # the rewritten image's grid changed, the others did not
        assert not torch.equal(second[copied_images[3]], first[copied_images[3]])
        assert torch.equal(second[copied_images[0]], first[copied_images[0]])


def test_weights_fingerprint_is_in_the_module_key() -> None:
    net = CaptionerConfig(vocab_size=10, backbone="resnet18", weights=None, grid_size=2,
                          embed_dim=8, hidden_dim=8, attn_dim=8)
    torch.manual_seed(0)
    a = CaptioningModule(net=net).captioner.feature_cache_key()
    torch.manual_seed(1)
    b = CaptioningModule(net=net).captioner.feature_cache_key()
    assert a["weights"] != b["weights"] and {**a, "weights": 0} == {**b, "weights": 0}


def test_pickling_drops_the_open_memmap(copied_images: list[Path], tmp_path: Path) -> None:
    cache = _build(tmp_path / "f", tiny_encoder(), copied_images)
    value = cache[copied_images[1]]
    assert isinstance(cache._array, np.memmap)
    clone = pickle.loads(pickle.dumps(cache))
    assert clone._array is None  # reopened lazily in the receiving process
    assert torch.equal(clone[copied_images[1]], value)
    assert cache._array is not None  # the original keeps its map


def test_dataloader_workers_read_cached_inputs(copied_images: list[Path], tmp_path: Path) -> None:
    cache = _build(tmp_path / "f", tiny_encoder(), copied_images)
    assert cache.array is not None  # already open in the parent
    ds = CachedInputs(cache, copied_images)
    loader = DataLoader(ds, batch_size=2, num_workers=2)  # fork: the default
    got = torch.cat(list(loader))
    assert torch.equal(got, torch.stack([ds[i] for i in range(len(ds))]))


def test_a_batch_copies_the_cache_once_and_a_read_is_a_copy(copied_images: list[Path],
                                                             tmp_path: Path) -> None:
    """`CachedInputs` hands the batch's stack views of the read-only map (its one copy);
    `cache[path]` is a copy of its own, which a caller may write into."""
    cache = _build(tmp_path / "f", tiny_encoder(), copied_images)
    row = cache.index[str(copied_images[2].resolve())]
    mapped = torch.from_numpy(np.asarray(cache.array[row]))
    view = CachedInputs(cache, copied_images)[2]
    assert view.dtype == torch.float16 and torch.equal(view, mapped)
    assert view.untyped_storage().data_ptr() == mapped.untyped_storage().data_ptr()
    own = cache[copied_images[2]]
    assert torch.equal(own, view) and own.data_ptr() != view.data_ptr()
    own.zero_()  # the caller's copy only
    assert torch.equal(cache[copied_images[2]], view) and bool(view.ne(0).any())


# -- training: the CNN runs only when fine-tuning --------------------------------------------


def _module(dm: CaptionDataModule, *, finetune: bool, attention: str = "soft") -> CaptioningModule:
    net = CaptionerConfig(backbone="resnet18", weights=None, grid_size=2, image_size=S,
                          finetune_encoder=finetune, embed_dim=16, hidden_dim=16, attn_dim=16,
                          attention=attention)
    return CaptioningModule(vocab_size=dm.vocab_size, net=net, compute_metrics=False,
                            decode=DecodeConfig(strategy="greedy", max_len=6))


class _CountCNN(L.Callback):
    """Counts CNN calls per train batch; with `forbid`, any call fails the batch."""

    def __init__(self, *, forbid: bool) -> None:
        self.forbid, self.calls, self.batches, self.input_dims = forbid, 0, 0, set()

    def on_train_start(self, trainer: L.Trainer, pl_module: CaptioningModule) -> None:
        body = pl_module.captioner.encoder.body
        original = body.forward

        def counted(x: torch.Tensor) -> torch.Tensor:
            self.calls += 1
            if self.forbid:
                raise _Forbidden("the CNN ran during training")
            return original(x)

        body.forward = counted  # type: ignore[method-assign]

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.batches += 1
        self.input_dims.add(batch.images.dim())


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_frozen_encoder_training_never_runs_the_cnn(shapes_dm_kwargs: dict, tmp_path: Path,
                                                    tiny_fit: Any,
                                                    attention: str) -> None:
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "feature_cache": True,
                              "cache_dir": str(tmp_path / "features")})
    cb = _CountCNN(forbid=True)
    tiny_fit(dm, _module(dm, finetune=False, attention=attention), tmp_path, callbacks=[cb],
             train_batches=3)
    assert cb.batches == 3 and cb.calls == 0 and cb.input_dims == {3}  # (B, L, D) grids


def test_finetuning_runs_the_cnn_every_batch(shapes_dm_kwargs: dict, tmp_path: Path,
                                             tiny_fit: Any) -> None:
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "feature_cache": True,
                              "cache_dir": str(tmp_path / "features")})
    cb = _CountCNN(forbid=False)
    tiny_fit(dm, _module(dm, finetune=True), tmp_path, callbacks=[cb], train_batches=3)
    assert not (tmp_path / "features").exists()  # nothing cached
    assert cb.input_dims == {4}  # images
    assert cb.calls == cb.batches + 1  # every train batch, plus the one validation batch


# -- `captioning cache-features` ------------------------------------------------------------


def test_cache_features_command_builds_every_split(shapes_dm_kwargs: dict, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from captioning.cli import main

    cfg = tmp_path / "config.yaml"
    data = {**shapes_dm_kwargs, "cache_dir": str(tmp_path / "features")}
    source = data["source"]
    lines = ["seed_everything: 0", "trainer:", "  accelerator: cpu", "  logger: false",
             f"  default_root_dir: {tmp_path}", "data:", "  source:",
             "    class_path: captioning.data.sources.ShapesSource", "    init_args:",
             f"      root: {source.root}"]
    lines += [f"      {k}: {v}" for k, v in source.params.items()]
    lines += [f"  {k}: {v}" for k, v in data.items() if k != "source"]
    lines += ["model:", "  net:", "    backbone: resnet18", "    weights: null",
              "    grid_size: 2", "    embed_dim: 8", "    hidden_dim: 8", "    attn_dim: 8"]
    cfg.write_text("\n".join(lines) + "\n")
    assert main(["cache-features", "--config", str(cfg)]) == 0
    built = sorted((tmp_path / "features").glob("*.npy"))
    assert len(built) == 3  # train, val, test
    stamps = [p.stat().st_mtime_ns for p in built]

    # A later `fit` with the same config finds them: training never builds a cache.
    dm = CaptionDataModule(**data)
    L.seed_everything(0)  # the CLI seeds before it builds the model: rebuild it the same way
    module = CaptioningModule(vocab_size=dm.vocab_size, net=CaptionerConfig(
        backbone="resnet18", weights=None, grid_size=2, image_size=S, embed_dim=8,
        hidden_dim=8, attn_dim=8))
    _forbid(module.captioner.encoder, monkeypatch)
    attach_feature_cache(dm, module.captioner.encoder, module.captioner.feature_cache_key(),
                         device="cpu")
    assert set(dm.cache_features()) == {"train", "val", "test"}
    assert [p.stat().st_mtime_ns for p in built] == stamps

    assert main(["cache-features", "--config", str(cfg),
                 "--model.net.finetune_encoder", "true"]) == 2


# -- precision and compile ------------------------------------------------------------------


@pytest.mark.parametrize("attention", ["soft", "hard"])
def test_bf16_autocast_forward_backward_is_finite(attention: str) -> None:
    torch.manual_seed(0)
    net = CaptionerConfig(vocab_size=20, backbone="resnet18", weights=None, grid_size=3,
                          embed_dim=32, hidden_dim=32, attn_dim=32, attention=attention)
    module = CaptioningModule(net=net)
    module.train()
    B, T = 5, 7
    lengths = torch.tensor([7, 7, 5, 4, 3])
    captions = torch.randint(4, 20, (B, T))
    captions[:, 0] = 1
    for i, n in enumerate(lengths.tolist()):
        captions[i, n - 1], captions[i, n:] = 2, 0
    batch = type("B", (), {"images": torch.randn(B, 9, 512), "captions": captions,
                           "lengths": lengths})()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        parts = module.losses(batch)
        out = module.captioner(batch.images, captions, lengths)
    assert out.logits.dtype == torch.bfloat16  # the matmuls did run in bf16
    assert out.alphas.dtype == torch.float32  # the attention softmax stays float32
    torch.testing.assert_close(out.alphas.sum(-1)[0], torch.ones(T - 1), atol=1e-5, rtol=0)
    assert torch.isfinite(parts["loss"])
    parts["loss"].backward()
    grads = [p.grad for p in module.captioner.decoder.parameters() if p.grad is not None]
    assert grads and all(torch.isfinite(g).all() for g in grads)


def test_a_cache_is_named_by_its_images_encoder_and_size(tmp_path: Path) -> None:
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    a.write_bytes(b"a")
    b.write_bytes(b"bb")
    cfg = {"backbone": "resnet18"}
    key, rows = cache_identity(encoder_config=cfg, image_size=64, paths=[a, str(b), a])
    assert rows == [a.resolve(), b.resolve()]  # one row per image, first occurrence kept
    assert all(CACHE_NAME_RE.match(f.name) for f in cache_files(tmp_path, key))
    assert cache_identity(encoder_config=cfg, image_size=64, paths=[a, b])[0] == key
    others = [cache_identity(encoder_config=cfg, image_size=32, paths=[a, b])[0],
              cache_identity(encoder_config={"backbone": "vgg19"}, image_size=64,
                             paths=[a, b])[0],
              cache_identity(encoder_config=cfg, image_size=64, paths=[b, a])[0]]
    # pinned: a change in how keys are made would orphan every cache already built
    assert cache_identity(encoder_config=cfg, image_size=64, paths=[])[0] == \
        "c78bfbeefdb78969952d"
    os.utime(a, ns=(0, 0))  # an image changed on disk (its mtime)
    others.append(cache_identity(encoder_config=cfg, image_size=64, paths=[a, b])[0])
    assert len({key, *others}) == 5


# -- grids held on the device (`features_on_device`) ----------------------------------------


def _cached_dm(shapes_dm_kwargs: dict, cache_dir: Path, **over: Any) -> CaptionDataModule:
    dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 8, "feature_cache": True,
                              "cache_dir": str(cache_dir), **over})
    dm.setup("fit")
    L.seed_everything(0)  # the same encoder, so the same cache
    module = _module(dm, finetune=False)
    attach_feature_cache(dm, module.captioner.encoder, module.captioner.feature_cache_key(),
                         device="cpu")
    return dm


@pytest.mark.parametrize("workers", [0, 1])
def test_grids_on_the_device_give_the_loaders_batches(shapes_dm_kwargs: dict, tmp_path: Path,
                                                      workers: int) -> None:
    """Batches of rows, gathered after the transfer, equal the loader's batches of grids."""
    loader = _cached_dm(shapes_dm_kwargs, tmp_path / "f", num_workers=workers)
    rows = _cached_dm(shapes_dm_kwargs, tmp_path / "f", num_workers=workers,
                      features_on_device=True)
    for get in ("train_dataloader", "val_dataloader"):
        for a, b in zip(getattr(loader, get)(), getattr(rows, get)(), strict=True):
            assert b.grid_split in ("train", "val") and b.images.shape == (len(b),)
            b = rows.on_after_batch_transfer(b, 0)
            assert b.grid_split is None and b.images.dtype == torch.float16
            assert torch.equal(a.images, b.images) and torch.equal(a.captions, b.captions)
            assert a.image_ids == b.image_ids and a.references == b.references
    assert loader.on_after_batch_transfer(a, 0) is a  # a batch of grids passes as it is


class _HeldSplits(L.Callback):
    """The splits whose grids the data module holds when training starts, and the inputs'
    dimensions that every training step gets."""

    def __init__(self) -> None:
        self.held: set[str] = set()
        self.dims: set[int] = set()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.held = set(trainer.datamodule.device_grids.held)

    def on_test_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.held = set(trainer.datamodule.device_grids.held)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.dims.add(batch.images.dim())


def test_training_from_grids_on_the_device_equals_the_loaders(shapes_dm_kwargs: dict,
                                                              tmp_path: Path,
                                                              tiny_fit: Any) -> None:
    states = []
    for on_device in (False, True):
        L.seed_everything(0)
        dm = CaptionDataModule(**{**shapes_dm_kwargs, "batch_size": 8, "feature_cache": True,
                                  "cache_dir": str(tmp_path / "f"),
                                  "features_on_device": on_device})
        module, held = _module(dm, finetune=False), _HeldSplits()
        trainer = tiny_fit(dm, module, tmp_path / str(on_device), train_batches=3,
                           callbacks=[held])
        assert held.held == ({"train", "val"} if on_device else set()) and held.dims == {3}
        assert not dm.device_grids.held  # the fit's teardown let them go
        states.append({k: v.clone() for k, v in module.state_dict().items()})
        (scores,) = trainer.test(module, datamodule=dm, verbose=False)
        assert held.held == ({"test"} if on_device else set())  # the test stage's split only
        states[-1]["test/loss"] = torch.tensor(scores["test/loss"])
    assert states[0].keys() == states[1].keys()
    for k in states[0]:
        assert torch.equal(states[0][k], states[1][k]), k


class _StepInputs(L.Callback):
    """Each training step's inputs, as the step gets them."""

    def __init__(self) -> None:
        self.images: list[torch.Tensor] = []

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, idx: int) -> None:
        self.images.append(batch.images)


@pytest.mark.parametrize("on_device", [False, True])
def test_a_batch_moves_itself_and_takes_the_precisions_dtype_after_the_move(
        shapes_dm_kwargs: dict, tmp_path: Path, on_device: bool) -> None:
    """Lightning's transfer calls `CaptionBatch.to` (no walk through every reference) and its
    bf16-true cast passes the batch over (no cast on the host); the data module casts the
    inputs after the transfer, to the values Lightning's cast would give."""
    from lightning.fabric.utilities.apply_func import move_data_to_device
    from lightning.pytorch.plugins.precision import HalfPrecision

    dm = _cached_dm(shapes_dm_kwargs, tmp_path / "f", features_on_device=on_device)
    batch = next(iter(dm.train_dataloader()))
    assert HalfPrecision("bf16-true").convert_input(batch) is batch
    moved = move_data_to_device(batch, torch.device("cpu"))
    assert moved.references is batch.references and moved.image_ids is batch.image_ids
    assert torch.equal(moved.images, batch.images) and moved.grid_split == batch.grid_split

    steps = _StepInputs()
    trainer = L.Trainer(max_steps=2, limit_val_batches=0, num_sanity_val_steps=0,
                        precision="bf16-true", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        accelerator="cpu", devices=1, callbacks=[steps],
                        default_root_dir=str(tmp_path))
    L.seed_everything(0)
    trainer.fit(_module(dm, finetune=False), datamodule=dm)
    assert len(steps.images) == 2
    L.seed_everything(0)  # the same shuffle: the loader's batches of float16 grids
    grids = [b.images for b, _ in zip(_cached_dm(shapes_dm_kwargs, tmp_path / "f")
                                      .train_dataloader(), range(2))]
    for got, grid in zip(steps.images, grids, strict=True):
        assert grid.dtype == torch.float16 and got.dtype == torch.bfloat16
        assert torch.equal(got, grid.to(torch.bfloat16))


def test_a_later_stage_holds_only_its_own_split(shapes_dm_kwargs: dict, tmp_path: Path) -> None:
    dm = _cached_dm(shapes_dm_kwargs, tmp_path / "f", features_on_device=True)
    dm.hold_grids("cpu", stage="fit")
    assert set(dm.device_grids.held) == {"train", "val"}
    dm.teardown("fit")
    dm.setup("test")
    batch = next(iter(dm.test_dataloader()))
    assert batch.grid_split == "test" and not dm.device_grids.held
    got = dm.on_after_batch_transfer(batch, 0)  # held on first use, where nothing held it
    assert set(dm.device_grids.held) == {"test"} and got.images.dim() == 3


def test_every_rank_stops_when_one_has_no_room(shapes_dm_kwargs: dict, tmp_path: Path) -> None:
    dm = _cached_dm(shapes_dm_kwargs, tmp_path / "f", features_on_device=True)
    dm.teardown("fit")  # held by the attach: let them go
    verdicts: list[bool] = []

    def another_rank_lacks_room(fits: bool) -> bool:
        verdicts.append(fits)
        return False

    with pytest.raises(CacheError, match=r"the train split's 24 and the val split's 8 grids "
                                         r"do not fit on another process's GPU"):
        dm.hold_grids("cpu", stage="fit", agree=another_rank_lacks_room)
    assert verdicts == [True] and not dm.device_grids.held
    dm.hold_grids("cpu", stage="fit", agree=lambda fits: fits)
    assert set(dm.device_grids.held) == {"train", "val"}
    with pytest.raises(CacheError, match="the grids do not fit"):  # nothing to copy: it asks
        dm.hold_grids("cpu", stage="fit", agree=another_rank_lacks_room)
    assert verdicts == [True, True]


def test_every_rank_stops_when_one_cannot_copy(shapes_dm_kwargs: dict, tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """The second verdict: whether the copy worked, on every rank."""
    dm = _cached_dm(shapes_dm_kwargs, tmp_path / "f", features_on_device=True)
    dm.teardown("fit")
    verdicts: list[bool] = []

    def the_other_rank_fails_its_copy(fits: bool) -> bool:
        verdicts.append(fits)
        return len(verdicts) == 1  # they fit everywhere; then one copy fails

    with pytest.raises(CacheError, match="another process could not hold the train split's"):
        dm.hold_grids("cpu", stage="fit", agree=the_other_rank_fails_its_copy)
    assert verdicts == [True, True] and not dm.device_grids.held

    def out_of_memory(cache: FeatureCache, device: Any, **kw: Any) -> torch.Tensor:
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(device_grids, "to_device", out_of_memory)
    verdicts.clear()
    with pytest.raises(torch.OutOfMemoryError):  # this rank's own error, after telling them
        dm.hold_grids("cpu", stage="fit", agree=lambda ok: verdicts.append(ok) or all(verdicts))
    assert verdicts == [True, False] and not dm.device_grids.held


class OneRank:
    """A Lightning strategy's rank for `attach_feature_cache`: rank zero's broadcast gives the
    other ranks `opened` and its error line `told`; `sent` records this rank's broadcasts."""

    def __init__(self, zero: bool, told: str | None = None, opened: list[str] | None = None
                 ) -> None:
        self.is_global_zero, self.told, self.root_device = zero, told, torch.device("cpu")
        self.opened = opened
        self.sent: list[Any] = []  # (what rank zero opened, its error line)

    def broadcast(self, obj: tuple[Any, str | None, None], src: int = 0
                  ) -> tuple[Any, str | None, None]:
        self.sent.append(obj[:2])
        return obj if self.is_global_zero else (self.opened, self.told, None)


class Opens:
    """A data module's `use_encoder_cache`, counted, raising `error` where given; it opened
    `opened_caches`, and was told `checked`."""

    features_on_device = False

    def __init__(self, error: Exception | None = None, opened: tuple[str, ...] = ()) -> None:
        self.error, self.calls, self.opened_caches = error, 0, list(opened)
        self.checked: Any = None

    def use_encoder_cache(self, encoder: Any, key: Any, device: Any = None,
                          checked: Any = ()) -> None:
        self.calls, self.checked = self.calls + 1, checked
        if self.error is not None:
            raise self.error


def test_every_rank_stops_when_rank_zero_cannot_build_the_cache() -> None:
    """Rank zero builds, then tells the others its outcome: its error stops them at once, in
    its line (a bare barrier held them until the collective's timeout)."""
    from captioning.distributed import RankZeroFailed

    zero, dm = OneRank(zero=True), Opens(CacheError("cannot write the feature cache: no room"))
    with pytest.raises(CacheError, match="no room"):  # its own error, after telling them
        attach_feature_cache(dm, None, {}, strategy=zero)
    assert zero.sent == [(None, "CacheError: cannot write the feature cache: no room")]
    other, dm = OneRank(zero=False, told=zero.sent[0][1]), Opens()
    with pytest.raises(RankZeroFailed, match=r"^rank zero could not build the feature cache, "
                                             r"so this rank stops: CacheError: cannot write"):
        attach_feature_cache(dm, None, {}, strategy=other)
    assert dm.calls == 0  # nothing opened, nothing built here
    zero, dm = OneRank(zero=True), Opens(opened=("/c/train.npy", "/c/val.npy"))
    attach_feature_cache(dm, None, {}, strategy=zero)  # it went well: all open
    assert dm.calls == 1 and zero.sent == [(["/c/train.npy", "/c/val.npy"], None)]
    other, dm = OneRank(zero=False, opened=zero.sent[0][0]), Opens()
    attach_feature_cache(dm, None, {}, strategy=other)
    # the others are told which files rank zero has just checked: no second full check
    assert dm.calls == 1 and dm.checked == ["/c/train.npy", "/c/val.npy"]


def test_a_cache_another_process_has_just_checked_is_opened_by_its_size(
        copied_images: list[Path], tmp_path: Path) -> None:
    """`checked` (rank zero's files, in a DDP fit) skips the hashes of those files only: the
    same damage that a full check finds goes unread there, and is found in a file of another
    name."""
    kwargs = {"cache_dir": tmp_path / "c", "encoder": tiny_encoder(),
              "encoder_config": {"backbone": "resnet18"}, "image_size": S,
              "paths": copied_images, "transform": build_image_transform(S), "progress": False}
    built = FeatureCache.build(**kwargs)
    with open(built.array_path, "r+b") as f:  # same size, other bytes
        f.seek(-4, os.SEEK_END)
        f.write(b"\xff\xff\xff\xff")
    trusted = FeatureCache.build(**kwargs, checked={str(built.array_path)})
    assert trusted.array_path == built.array_path and trusted.verify == "size"
    assert built.array_path.with_suffix(".json").exists()  # not rebuilt
    rechecked = FeatureCache.build(**kwargs, checked={str(tmp_path / "other.npy")})
    assert rechecked.verify == "full"  # the damage found: rebuilt, as any run would
    assert not np.array_equal(np.fromfile(built.array_path, np.uint8)[-4:], [255] * 4)


def test_grids_are_copied_a_chunk_at_a_time() -> None:
    from captioning.data.device_grids import copy_in_chunks

    array = np.arange(10 * 3 * 2, dtype=np.float16).reshape(10, 3, 2)
    for rows in (1, 3, 10, 64):
        out = torch.full((10, 3, 2), -1.0, dtype=torch.float16)
        copy_in_chunks(array, out, rows)
        assert torch.equal(out, torch.from_numpy(array))
    with pytest.raises(ValueError, match="cannot copy"):
        copy_in_chunks(array, torch.empty(9, 3, 2, dtype=torch.float16), 4)


def test_a_lazy_cache_is_checked_whole_before_it_goes_on_the_device(copied_images: list[Path],
                                                                    tmp_path: Path) -> None:
    cache = _build(tmp_path / "f", tiny_encoder(), copied_images)
    cpu = torch.device("cpu")
    on_cpu = device_grids.to_device(FeatureCache(cache.array_path, _index(cache), verify="lazy"),
                                    cpu)
    assert torch.equal(on_cpu, torch.from_numpy(np.asarray(cache.array)))
    with open(cache.array_path, "r+b") as f:  # damage the last row
        f.seek(-2, os.SEEK_END)
        f.write(b"\x00\x7c")
    lazy = FeatureCache(cache.array_path, _index(cache), verify="lazy")
    with pytest.raises(CacheError, match=r"rows \d+-\d+ differ from their hash"):
        device_grids.to_device(lazy, cpu)
    assert not cache.array_path.with_suffix(".json").exists()  # the next run rebuilds it


def _index(cache: FeatureCache) -> dict[str, Any]:
    import json

    return json.loads(cache.array_path.with_suffix(".json").read_text())


def test_grids_that_do_not_fit_the_gpu_are_refused_in_one_line() -> None:
    from captioning.data.device_grids import room_problem

    gpu, gb = torch.device("cuda", 0), 10**9
    assert room_problem(60 * gb, gpu, what="grids", free_total=(70 * gb, 80 * gb)) is None
    # 8 GB (a tenth of 80) stays free for training
    assert room_problem(63 * gb, gpu, what="the train split's 113,287 grids",
                        free_total=(70 * gb, 80 * gb)) == (
        "data.features_on_device: the train split's 113,287 grids need 63.0 GB on cuda:0, "
        "which has 70.0 GB free of 80.0 GB and keeps 8.0 GB for training; set "
        "data.features_on_device false to read them through the loader")
    small = room_problem(7 * gb, gpu, what="grids", free_total=(8 * gb, 8 * gb))
    assert small is not None and "keeps 2.1 GB" in small  # at least 2 GiB on a small GPU
    assert room_problem(10**15, torch.device("cpu"), what="grids") is None  # the map itself
