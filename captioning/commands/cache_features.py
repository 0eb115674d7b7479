"""`captioning cache-features --config ... [--data.* ...]`: build the feature caches, no training.

Takes the same config files and overrides as `captioning fit`; builds (or finds) the feature
cache of every non-empty split for the model's frozen encoder, on the trainer's device, through
the same attach path as `fit`, and logs where each one is.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if any(a in ("-h", "--help") for a in args):
        sys.stdout.write(f"{__doc__}\nOptions are those of `captioning fit` "
                         "(see `captioning fit --help`).\n")
        return 0
    from captioning.commands.lightning import lightning_cli
    from captioning.data.features import attach_feature_cache

    cli = lightning_cli(args, run=False)
    captioner, dm = cli.model.captioner, cli.datamodule
    if captioner.config.finetune_encoder:
        log.error("net.finetune_encoder is true: a fine-tuned encoder's features are never "
                  "cached (training runs the CNN on every batch)")
        return 2
    if not getattr(dm, "feature_cache", False):
        log.warning("data.feature_cache is false: training will not use the cache built now")
    attach_feature_cache(dm, captioner.encoder, captioner.feature_cache_key(),
                         device=cli.trainer.strategy.root_device)
    for split, cache in dm.cache_features().items():
        log.info("%s: %d images, grids %s -> %s", split, len(cache), tuple(cache.shape),
                 cache.array_path)
    return 0
