"""The random streams a checkpoint carries, so that a resumed fit continues them where they
stopped: torch's (CPU, CUDA), numpy's and Python's, as tensors and plain data (checkpoints stay
loadable with `torch.load(weights_only=True)`). Under DDP every rank's own, in rank order."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from captioning.distributed import all_gather_objects, world_size


def rng_states() -> dict[str, Any]:
    """This process's torch (CPU, CUDA), numpy and python RNG states."""
    _, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {"keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: Mapping[str, Any]) -> None:
    """Restore what `rng_states` returned (missing parts are left alone)."""
    if "torch" in states:
        torch.set_rng_state(states["torch"].cpu())
    if "numpy" in states:
        n = states["numpy"]
        np.random.set_state(("MT19937", n["keys"].cpu().numpy().astype(np.uint32), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    cuda = states.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([t.cpu() for t in cuda])


def saved_rng_states() -> dict[str, Any]:
    """What a checkpoint stores: `rng_states` of this process (rank zero's in the file), and
    under DDP every rank's under "ranks", in rank order. A collective there: every rank saves a
    checkpoint together (Lightning's `Trainer.save_checkpoint`)."""
    states = rng_states()
    if world_size() > 1:  # each rank's pickled as gathered, before "ranks" is added
        states["ranks"] = all_gather_objects(states)
    return states


def restore_rng_states(states: Mapping[str, Any], *, rank: int, world: int) -> None:
    """`set_rng_states` of rank `rank`'s own streams, where `states` holds one per rank of a
    run of `world` ranks; else of the process that saved them (an older checkpoint, or one of
    another number of ranks)."""
    ranks = states.get("ranks")
    set_rng_states(ranks[rank] if isinstance(ranks, list) and len(ranks) == world else states)
