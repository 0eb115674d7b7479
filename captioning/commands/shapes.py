"""`captioning shapes --root DIR`: write the synthetic shapes dataset."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Sequence

log = logging.getLogger(__name__)


def main(argv: Sequence[str] | None = None) -> int:
    from captioning.data.shapes import generate_shapes

    p = argparse.ArgumentParser(prog="captioning shapes", description="Write the shapes dataset.")
    p.add_argument("--root", default="data/shapes")
    p.add_argument("--num-train", type=int, default=6000)
    p.add_argument("--num-val", type=int, default=250)
    p.add_argument("--num-test", type=int, default=500)
    p.add_argument("--image-size", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    root = generate_shapes(a.root, num_train=a.num_train, num_val=a.num_val,
                           num_test=a.num_test, image_size=a.image_size, seed=a.seed)
    log.info("shapes dataset ready at %s", root)
    return 0
