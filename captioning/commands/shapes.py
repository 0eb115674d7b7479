"""`captioning shapes --root DIR`: write the synthetic shapes dataset."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    from captioning.data.shapes import DEFAULT_PARAMS, DEFAULT_ROOT, generate_shapes

    p = argparse.ArgumentParser(prog="captioning shapes", description="Write the shapes dataset.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--root", default=DEFAULT_ROOT, help="the dataset's folder")
    helps = {"num_train": "training images", "num_val": "validation images",
             "num_test": "test images", "image_size": "image side, pixels",
             "seed": "random seed"}
    for name, value in DEFAULT_PARAMS.items():  # the defaults `fit --config data/shapes` reads
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=value, help=helps[name])
    a = p.parse_args(argv)
    root = generate_shapes(a.root, num_train=a.num_train, num_val=a.num_val,
                           num_test=a.num_test, image_size=a.image_size, seed=a.seed)
    log.info("shapes dataset ready at %s", root)
    return 0
