"""Registering ``testccl``, the test device's collective backend, with torch.distributed.

The backend itself is C++ (``csrc/ccl.cpp``): a ``c10d::Backend`` for the device type that
stages every collective through a Gloo process group. Gloo's C++ headers are not shipped
with torch, so the Gloo group is made here, in Python, and handed to the C++ backend. It is
made the way portspeed makes its Gloo groups (``portspeed.comm.gloo_init``: connected at first
use unless ``PORTSPEED_GLOO_LAZY_INIT=0`` or the user set ``TORCH_GLOO_LAZY_INIT``): Megatron
creates dozens of groups, and an eager staging group connects all its pairs at creation.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch.distributed as dist

from portspeed.trace import staging as trace_staging

__all__ = ["BACKEND_NAME", "register_backend"]

BACKEND_NAME = "testccl"


def _creator(ext: Any):
    def create(store: Any, rank: int, size: int, timeout: datetime.timedelta) -> Any:
        from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo

        from portspeed.comm.gloo_init import lazy_gloo

        # torch reads TORCH_GLOO_LAZY_INIT when the options are made, not when the group is: both inside
        with lazy_gloo("gloo"):
            options = ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [ProcessGroupGloo.create_default_device()]
            gloo = ProcessGroupGloo(PrefixStore("testccl-staging/", store), rank, size, options)
        # listed in the flight recorder's dumps (PORTSPEED_TRACE) as a staging group; its calls are made in C++
        trace_staging.label(BACKEND_NAME, rank, size, "inner Gloo group every testccl collective is staged "
                            "through, from C++: its calls are not recorded")
        return ext.create_backend(gloo, rank, size)

    return create


def register_backend(ext: Any, device_type: str) -> None:
    """Register ``testccl`` for ``device_type`` (once per process)."""
    if getattr(dist.Backend, BACKEND_NAME.upper(), None) is not None:
        return
    dist.Backend.register_backend(BACKEND_NAME, _creator(ext), devices=[device_type])
