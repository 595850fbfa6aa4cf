"""Backend names: the one a framework asks for, the one the active adapter runs, and the map between them.

Why: Megatron and DeepSpeed ask for ``"nccl"`` whatever the device, and some of their code
later compares ``dist.get_backend() == "nccl"``. The router creates groups on the
adapter's backend (``map_backend``) and remembers what was asked (``requested_backend``)
so the name can be reported back; ``real_backend`` always says what really runs.

Contract
- ``map_backend(name)``: accelerator backends of other devices (``nccl``, ``hccl``...) and
  ``None`` become ``get_accelerator().communication_backend``; CPU backends (``gloo``,
  ``mpi``) and backends registered with torch stay; ``"cpu:gloo,cuda:nccl"`` maps each
  pair, the accelerator's backend winning on its own device. Unknown names raise
  UnknownBackendError listing the known ones. On an adapter that runs CUDA natively with
  nccl every mapping is the identity.
- ``real_backend(group)``: the backend torch created the group with.
- ``requested_backend(group)``: the name asked for (None: not recorded). The group
  wrappers (``portspeed.comm.groups``) fill and clear the record through ``remember``/``forget``.

Example::

    map_backend("nccl", CpuAccelerator())                 # 'gloo'
    map_backend("cpu:gloo,cuda:nccl", FakeNpuAccelerator())   # 'cpu:gloo,npu:hccl'
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portspeed.accelerator.capabilities import KNOWN_BACKENDS
from portspeed.accelerator.declarations import STAGED_BACKEND, groups_backend
from portspeed.errors import UnknownBackendError

__all__ = ["map_backend", "real_backend", "requested_backend"]

#: process group -> the backend name the caller asked for (mutated, never rebound)
_REQUESTED: dict[Any, str] = {}


def _accelerator() -> Any:
    from portspeed.accelerator import get_accelerator

    return get_accelerator()


def _map_one(name: str, acc: Any) -> str:
    target = groups_backend(acc)
    low = name.strip().lower()
    if low == STAGED_BACKEND:
        return low  # portspeed's own backend (registered for the device when a group is made: groups.py)
    if low == target or low in ("gloo", "mpi"):
        return low
    device = KNOWN_BACKENDS.get(low)
    if device is not None:
        if device == "cpu" or device == acc.device_type:
            return low
        return target
    registered = {b.lower() for b in getattr(dist.Backend, "backend_list", [])} - {"undefined"}
    if low in registered:
        return low
    known = sorted(set(KNOWN_BACKENDS) | registered)
    raise UnknownBackendError(
        f"unknown collective backend {name!r}; known: {', '.join(known)}. Pass one of these (or "
        "'device:backend' pairs such as 'cpu:gloo,cuda:nccl'), or register a vendor backend with "
        "torch.distributed.Backend.register_backend first"
    )


def map_backend(requested: str | None, accelerator: Any = None) -> str | None:
    """The backend to create a group with, for the ``requested`` name on the active adapter."""
    acc = accelerator if accelerator is not None else _accelerator()
    target = groups_backend(acc)
    if requested is None:
        if acc.runs_cuda_natively and target == "nccl":
            return None  # nothing changes where CUDA runs natively: torch picks its own default
        return target
    if not isinstance(requested, str) or not requested.strip():
        raise UnknownBackendError(
            f"backend must be a non-empty string such as 'nccl' or 'cpu:gloo,cuda:nccl', got {requested!r}"
        )
    if ":" not in requested:
        return _map_one(requested, acc)
    pairs: dict[str, str] = {}
    for part in requested.split(","):
        dev, sep, name = part.strip().partition(":")
        if not sep or not dev or not name:
            raise UnknownBackendError(
                f"backend string {requested!r} has a malformed part {part!r}; use 'device:backend' pairs "
                "separated by commas, e.g. 'cpu:gloo,cuda:nccl'"
            )
        dev = dev.strip().lower()
        mapped = _map_one(name, acc)
        if dev == "cuda":  # torch's device-type key in the caller's spec: the adapter's device takes its place
            dev = acc.device_type
        if dev == acc.device_type and mapped == target:
            pairs[dev] = mapped  # the accelerator's backend wins on its own device
        else:
            pairs.setdefault(dev, mapped)
    if len(pairs) == 1:
        return next(iter(pairs.values()))
    return ",".join(f"{d}:{b}" for d, b in pairs.items())


def _pg(group: Any) -> Any:
    return group if group is not None else c10d._get_default_group()


def real_backend(group: Any = None) -> str:
    """The backend a group really runs on (what torch created), whatever get_backend() reports."""
    pg = _pg(group)
    entry = c10d._world.pg_map.get(pg)
    if entry is None:
        raise ValueError(f"{group!r} is not a process group of this process (or this rank is not in it)")
    return str(entry[0])


def requested_backend(group: Any = None) -> str | None:
    """The backend name the caller asked for when creating ``group`` (None: not recorded)."""
    return _REQUESTED.get(_pg(group))


def remember(group: Any, name: str) -> None:
    """Record ``name`` as what the caller asked for when creating ``group`` (torch's spelling)."""
    _REQUESTED[group] = str(dist.Backend(name)) if ":" not in name else name.lower()


def forget(group: Any = None) -> None:
    """Drop the record of ``group`` (None: of every group)."""
    if group is None:
        _REQUESTED.clear()
    else:
        _REQUESTED.pop(group, None)
