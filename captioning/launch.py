"""What a launcher (torchrun, Lightning's DDP, SLURM) tells a process through its environment,
read before torch.distributed is set up; imports nothing heavy, for the commands' start-up."""

from __future__ import annotations

import os
from collections.abc import Mapping

#: The variables by which a launcher gives a process its rank and its group's rendezvous
#: (torchrun sets every one of these; Lightning's DDP sets LOCAL_RANK, NODE_RANK, WORLD_SIZE,
#: MASTER_ADDR and MASTER_PORT).
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "GROUP_RANK", "NODE_RANK", "ROLE_RANK", "WORLD_SIZE",
                      "LOCAL_WORLD_SIZE", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME",
                      "MASTER_ADDR", "MASTER_PORT")
#: Prefixes of a launcher's other variables: torchrun's (whose TORCHELASTIC_RUN_ID alone makes
#: Lightning take a process for a torchrun worker) and SLURM's (a cluster's, to Lightning).
LAUNCHER_PREFIXES = ("TORCHELASTIC_", "SLURM_")


def fresh_launch_env(env: Mapping[str, str]) -> dict[str, str]:
    """`env` without a launcher's variables (`LAUNCHER_VARIABLES`, `LAUNCHER_PREFIXES`): for a
    child process that sets up its own ranks, or none."""
    return {k: v for k, v in env.items()
            if k not in LAUNCHER_VARIABLES and not k.startswith(LAUNCHER_PREFIXES)}


def launcher_rank_zero(env: Mapping[str, str] | None = None) -> bool:
    """Whether this process is (or will be) global rank zero, from a launcher's variables
    (`env`, by default the process's): before a trainer has started and knows its rank."""
    env = os.environ if env is None else env
    return all(env.get(k, "0") in ("", "0")
               for k in ("RANK", "LOCAL_RANK", "NODE_RANK", "SLURM_PROCID"))
