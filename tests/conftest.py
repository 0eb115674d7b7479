"""Shared fixtures: a tiny shapes dataset, and writers of tiny Karpathy / raw-COCO files."""

from __future__ import annotations

import json
import shutil
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image

from captioning.data.shapes import generate_shapes
from captioning.data.sources import ShapesSource
from captioning.vocab import tokenize

# scripts/ on the path, as when a script runs: the benchmark's parts (bench/) and gpu_check
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
pytest.register_assert_rewrite("tiny_runs")  # its helpers' asserts report in detail
from tiny_runs import cache_dir, fitted, signal_handlers_restored  # noqa: E402, F401 (fixtures)

#: Parameters of the session's shapes dataset (ShapesSource / generate_shapes arguments).
SHAPES_PARAMS: dict[str, int] = {"num_train": 24, "num_val": 8, "num_test": 8,
                                 "image_size": 64, "seed": 0}


def decoder_and_batch(dims: tuple[int, int, int, int], dropout: float, *, grouped: bool = False,
                      **settings: Any
                      ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor, torch.Generator]:
    """A decoder (B, L, D, H: batch, locations, feature and hidden width; vocabulary 40; more
    `settings`) from seed 0 and a random batch: (decoder, features (B, L, D), captions (B, 15),
    lengths (B,), the batch's generator, for more draws). `grouped`: caption i shows image
    i // 5, shuffled."""
    from captioning.models.decoder import AttentionLSTMDecoder

    B, L, D, H = dims
    torch.manual_seed(0)
    dec = AttentionLSTMDecoder(vocab_size=40, feature_dim=D, embed_dim=H, hidden_dim=H,
                               attn_dim=H, dropout=dropout, **settings)
    g = torch.Generator().manual_seed(2)
    feats = torch.randn(B, L, D, generator=g).relu()
    if grouped:
        feats = feats[torch.randperm(B, generator=g) // 5]
    lengths = torch.randint(4, 15, (B,), generator=g)
    caps = torch.randint(4, 40, (B, 15), generator=g)
    return dec, feats, caps, lengths, g


#: For the tests that score with pycocoevalcap (BLEU, METEOR, ...), whose scorers run Java.
needs_java = pytest.mark.skipif(shutil.which("java") is None, reason="needs Java")


def shapes_source(root: str | Path) -> ShapesSource:
    """The data source of the session's shapes dataset under `root`."""
    return ShapesSource(root=str(root), **SHAPES_PARAMS)


def boxes_table(path: Path) -> dict[Any, list[dict[str, Any]]]:
    """boxes.json as {image_id: objects}, read plainly: the reference for the package's
    readers and generator."""
    return {e["image_id"]: e["objects"] for e in json.loads(path.read_text())["images"]}


def shapes_cli_args(root: str | Path) -> list[str]:
    """LightningCLI flags for the session's shapes data under `root`, as `shapes_dm_kwargs`
    gives them to CaptionDataModule (64px, batch 4, eval batch 8)."""
    source = ["--data.source", "captioning.data.sources.ShapesSource",
              "--data.source.root", str(root),
              *[a for k, v in SHAPES_PARAMS.items() for a in (f"--data.source.{k}", str(v))]]
    return [*source, "--data.image_size", "64", "--data.batch_size", "4",
            "--data.eval_batch_size", "8"]


@pytest.fixture(autouse=True, scope="session")
def _one_thread() -> Any:
    """Test models are tiny and op-overhead bound: one intra-op thread is several times faster
    on a 2-core CPU than two."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def shapes_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny shapes dataset (24 train / 8 val / 8 test, 64px), generated once per session."""
    return generate_shapes(tmp_path_factory.mktemp("shapes") / "shapes", **SHAPES_PARAMS)


@pytest.fixture(scope="session")
def shapes_dm_kwargs(shapes_root: Path) -> dict[str, Any]:
    """CaptionDataModule keyword arguments for the session's shapes dataset (64px, batch 4);
    `shapes_cli_args(shapes_root)` gives the same as command-line flags."""
    return {"source": shapes_source(shapes_root),
            "image_size": 64, "batch_size": 4, "eval_batch_size": 8}


@pytest.fixture(scope="session")
def trained(shapes_dm_kwargs: dict[str, Any], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's tiny fitted captioner and its checkpoint (`trained.Trained`)."""
    from trained import trained_model

    return trained_model(shapes_dm_kwargs, tmp_path_factory)


@pytest.fixture
def copied_images(shapes_root: Path, tmp_path: Path) -> list[Path]:
    """Six shapes images copied into tmp_path (so that a test may rewrite one)."""
    out = []
    for p in sorted((shapes_root / "images").glob("train_*.png"))[:6]:
        out.append(tmp_path / "img" / p.name)
        out[-1].parent.mkdir(exist_ok=True)
        shutil.copy2(p, out[-1])
    return out


def _write_png(path: Path, color: tuple[int, int, int] = (200, 30, 30),
               size: tuple[int, int] = (8, 6)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", size, color).save(path)
    return path


@pytest.fixture
def write_png() -> Callable[..., Path]:
    """write_png(path, color=(r, g, b), size=(w, h)) -> path: a small solid-colour PNG."""
    return _write_png


def _write_karpathy(path: Path, images: Sequence[dict[str, Any]], *,
                    layout: str = "coco") -> Path:
    """Write a Karpathy split file in the real layout.

    Each spec: {"id", "filename", "split", "captions": [...], "filepath" (coco layout only)}.
    layout "coco" writes filepath + cocoid (like dataset_coco.json); "flickr" writes neither
    (like dataset_flickr8k.json / dataset_flickr30k.json).
    """
    entries, sent_id = [], 0
    for imgid, spec in enumerate(images):
        sentences = [{"tokens": tokenize(c), "raw": c, "imgid": imgid, "sentid": sent_id + k}
                     for k, c in enumerate(spec["captions"])]
        entry: dict[str, Any] = {"sentids": [s["sentid"] for s in sentences],
                                 "filename": spec["filename"], "split": spec["split"],
                                 "sentences": sentences}
        if layout == "coco":
            entry["filepath"] = spec.get("filepath", "train2014")
            entry["imgid"] = imgid
            entry["cocoid"] = spec["id"]
        else:
            entry["imgid"] = spec["id"]
        entries.append(entry)
        sent_id += len(sentences)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"images": entries, "dataset": layout}, indent=1))
    return path


def write_tiny_coco(root: Path) -> Path:
    """12 small JPEGs under root/train2014 and root/val2014 (8 train, 2 val, 2 test images, two
    captions each) and their root/dataset_coco.json, in Karpathy's COCO layout."""
    words = ["a red square", "a blue circle", "a green square", "a red circle"]
    specs = []
    for i in range(12):
        split = "train" if i < 8 else "val" if i < 10 else "test"
        folder = "train2014" if split == "train" else "val2014"
        _write_png(root / folder / f"{i}.jpg", color=(20 * i, 100, 200 - 10 * i), size=(40, 30))
        specs.append({"id": 100 + i, "filename": f"{i}.jpg", "split": split, "filepath": folder,
                      "captions": [words[i % 4], words[(i + 1) % 4]]})
    return _write_karpathy(root / "dataset_coco.json", specs)


def paper_shrink_args(work: Path) -> list[str]:
    """Overrides that shrink a paper config (trainer/gpu*, data/coco, paper_*) to run here: the
    CPU, fp32, random VGG-19 weights, 64 px images, two steps, no loader workers."""
    return ["--trainer.accelerator", "cpu", "--trainer.precision", "32-true",
            "--trainer.max_steps", "2", "--trainer.num_sanity_val_steps", "0",
            "--trainer.enable_progress_bar", "false",
            "--data.vocab_path", str(work / "vocab.json"), "--data.min_word_count", "1",
            "--data.image_size", "64", "--data.batch_size", "4", "--data.eval_batch_size", "4",
            "--data.num_workers", "0", "--data.pin_memory", "false",
            "--data.persistent_workers", "false",
            "--model.net.weights", "null", "--model.decode.max_len", "6"]


@pytest.fixture
def write_karpathy() -> Callable[..., Path]:
    """write_karpathy(path, images, *, layout="coco"|"flickr") -> path (see _write_karpathy)."""
    return _write_karpathy


def _write_coco(path: Path, images: Sequence[tuple[Any, str]],
                captions: Sequence[tuple[Any, str]]) -> Path:
    """Write a raw COCO captions file: images [(id, file_name)], captions [(image_id, text)]."""
    data = {
        "info": {"description": "tiny test captions", "version": "1.0", "year": 2014},
        "licenses": [{"id": 1, "name": "test", "url": ""}],
        "images": [{"license": 1, "file_name": fn, "coco_url": "", "height": 6, "width": 8,
                    "date_captured": "2013-11-14 11:18:45", "flickr_url": "", "id": i}
                   for i, fn in images],
        "annotations": [{"image_id": i, "id": 1000 + k, "caption": c}
                        for k, (i, c) in enumerate(captions)],
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def write_coco() -> Callable[..., Path]:
    """write_coco(path, images=[(id, file_name)], captions=[(image_id, caption)]) -> path."""
    return _write_coco


@pytest.fixture
def tiny_fit() -> Callable[..., Any]:
    """fit(dm, module, root, *, callbacks, logger=False, train_batches=2, sanity_steps=0): a
    short CPU `Trainer.fit` (1 epoch, 1 val batch, no checkpoints); returns the trainer."""
    import lightning.pytorch as L

    def fit(dm: Any, module: Any, root: Path, *, callbacks: Sequence[Any] = (),
            logger: Any = False, train_batches: int = 2, sanity_steps: int = 0) -> Any:
        trainer = L.Trainer(max_epochs=1, limit_train_batches=train_batches,
                            limit_val_batches=1, num_sanity_val_steps=sanity_steps,
                            logger=logger, callbacks=list(callbacks), enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            accelerator="cpu", devices=1, default_root_dir=str(root))
        trainer.fit(module, datamodule=dm)
        return trainer

    return fit


@pytest.fixture
def counted_compile(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """torch.compile with Dynamo's counting backend (the graphs run as traced, uncompiled): its
    `frame_count` is the graphs compiled. Dynamo is reset before and after."""
    from torch._dynamo.testing import CompileCounter

    counter, real = CompileCounter(), torch.compile
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: real(fn, backend=counter, **kw))
    torch._dynamo.reset()
    yield counter
    torch._dynamo.reset()
