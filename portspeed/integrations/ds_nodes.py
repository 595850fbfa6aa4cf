"""What DeepSpeed counts as a node: the ranks a launcher started on this machine.

Why: DeepSpeed derives its node topology from its accelerator's ``device_count()`` (qgZ's
``num_nodes = world // device_count()`` and its all-to-all groups, ``utils/groups.py``), so that
answer must be the node the user launched, not a device total: the test device's 8 devices and 2
ranks gave ``2 // 8 = 0`` nodes, and qgZ silently never engaged. portspeed's DeepSpeed accelerators
answer ``node_size()`` when a launcher said, else the adapter's device count.

To make every rank a node of its own on one machine (what qgZ needs to engage in a test), launch
one rank per node: ``torchrun --nnodes 2 --node-rank R --nproc-per-node 1 --rdzv-backend static
--master-addr 127.0.0.1 --master-port P`` once per R, or ``portspeed.testing.run_ranks(...,
ranks_per_node=1)``; each rank then sees ``LOCAL_WORLD_SIZE=1``.
"""

from __future__ import annotations

import os

from portspeed.errors import ConfigError

__all__ = ["NODE_SIZE_VARS", "node_size"]

#: what launchers set to the number of ranks they started on this node, read in this order: DeepSpeed's
#: launcher and its MPI runners (LOCAL_SIZE, what DeepSpeed's CPU accelerator reads), torchrun and
#: `portspeed run` (LOCAL_WORLD_SIZE), Open MPI's mpirun (OMPI_COMM_WORLD_LOCAL_SIZE)
NODE_SIZE_VARS = ("LOCAL_SIZE", "LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE")


def node_size() -> int | None:
    """The ranks the launcher started on this node (``NODE_SIZE_VARS``), or None when no launcher said.

    One rank per node (``LOCAL_WORLD_SIZE=1``: torchrun ``--nnodes 2 --nproc-per-node 1``, each
    node on this machine) makes every rank a node of its own, which DeepSpeed's qgZ needs to engage.
    """
    for var in NODE_SIZE_VARS:
        raw = os.environ.get(var, "").strip()
        if not raw:
            continue
        if not raw.isdigit() or int(raw) < 1:
            raise ConfigError(f"{var}={raw!r} is not a number of ranks on this node; the launcher sets it to a "
                              "positive integer (unset it, or set it to the ranks started on this node)")
        return int(raw)
    return None
