"""A tiny captioner fitted once per session, for the tests that need real weights and a real
checkpoint (checkpoint loading, `caption`, `predict`, `export`): `trained_model`, behind
conftest's `trained` fixture. Also `RunsCode`, a pickle that runs code when loaded.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from captioning.models.captioner import CaptionerConfig, DecodeConfig
from captioning.vocab import Vocabulary

NET = CaptionerConfig(backbone="resnet18", weights=None, grid_size=3, image_size=64,
                      embed_dim=16, hidden_dim=32, attn_dim=16, dropout=0.0)


@dataclass
class Trained:
    """A fitted CaptioningModule (eval mode), its checkpoint and the shapes test images."""

    module: Any  # CaptioningModule
    checkpoint: Path
    vocab: Vocabulary
    images: list[Path]

    def batch(self, paths: list[Path]) -> torch.Tensor:
        """The images as the caption CLI loads them (the project's loader and transform)."""
        from captioning.data.images import load_image
        from captioning.data.transforms import build_image_transform

        t = build_image_transform(self.module.net_config.image_size)
        return torch.stack([t(load_image(p, min_side=64)) for p in paths])

    def captions(self, paths: list[Path], decode: DecodeConfig | None = None) -> list[str]:
        """Captions of the LightningModule's own decoding (or with `decode`)."""
        with torch.no_grad():
            images = self.batch(paths)
            gen = (self.module.captioner.generate(images, decode) if decode is not None
                   else self.module.generate(images))
        return [" ".join(self.vocab.decode(t[:n])) for t, n in
                zip(gen.tokens.tolist(), gen.lengths.tolist())]


@functools.cache
def _train(shapes_root: str, dm_items: tuple[tuple[str, Any], ...], out: str) -> Trained:
    import lightning.pytorch as L

    from captioning.data.datamodule import CaptionDataModule
    from captioning.lit_module import CaptioningModule

    L.seed_everything(0, verbose=False)
    dm = CaptionDataModule(**dict(dm_items), feature_cache=False)
    module = CaptioningModule(vocab_size=dm.vocab_size, net=NET, decoder_lr=1e-2,
                              decode=DecodeConfig(beam_size=3, max_len=12),
                              compute_metrics=False)
    trainer = L.Trainer(max_steps=40, accelerator="cpu", devices=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=out)
    trainer.fit(module, datamodule=dm)
    ckpt = Path(out) / "tiny.ckpt"
    trainer.save_checkpoint(ckpt)
    images = sorted((Path(shapes_root) / "images").glob("test_*.png"))
    return Trained(module.eval(), ckpt, dm.vocab, images)


def trained_model(shapes_dm_kwargs: dict[str, Any],
                  tmp_path_factory: pytest.TempPathFactory) -> Trained:
    """The session's trained tiny model (fitted once, whichever test module asks first)."""
    out = tmp_path_factory.getbasetemp() / "trained-captioner"
    out.mkdir(exist_ok=True)
    return _train(str(shapes_dm_kwargs["source"].root), tuple(sorted(shapes_dm_kwargs.items())),
                  str(out))


class RunsCode:
    """Unpickling this calls exec(), which creates `marker`."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (exec, (f"open({str(self.marker)!r}, 'w').close()",))
