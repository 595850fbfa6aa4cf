"""The collective router applied in one process, for the router's tests (tests/test_router.py, test_router_rewrites.py).

``router_on_cpu()``: the router patches applied by a private manager on the CPU adapter, all undone after (the
``routed`` fixture of both files); ``init_one_rank``: a real group of one rank on a HashStore, enough for the
bookkeeping (multi-rank values are checked in tests/test_collective_conformance.py).
"""

from __future__ import annotations

import contextlib
import datetime
from typing import Iterator

import torch.distributed as dist

import portspeed
from portspeed import comm
from portspeed.accelerator import reset_accelerator, set_accelerator
from portspeed.adapters.cpu import CpuAccelerator
from portspeed.patches.torch_distributed import PATCHES

__all__ = ["GATHER_FNS", "init_one_rank", "router_on_cpu"]

#: the all-gather functions that take a flat output: torch 2.13 has all_gather_single besides the old name
GATHER_FNS = ["all_gather_into_tensor"] + (["all_gather_single"] if hasattr(dist, "all_gather_single") else [])


@contextlib.contextmanager
def router_on_cpu() -> Iterator[portspeed.PatchManager]:
    """The router patches applied by a private manager, on the CPU adapter; all undone after."""
    set_accelerator(CpuAccelerator())
    manager = portspeed.PatchManager()
    manager.register(PATCHES)
    manager.apply()
    comm.reset()
    try:
        yield manager
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        manager.revert()
        comm.reset()
        reset_accelerator()


def init_one_rank(backend: str | None = "nccl") -> None:
    """The default group, one rank, on a HashStore."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1,
                            timeout=datetime.timedelta(seconds=30))
