"""A ``DeviceMesh`` that framework code builds for ``"cuda"`` is built for the adapter's device type.

Why: Megatron builds torch ``DeviceMesh`` objects over its process groups with a literal
device type, ``DeviceMesh.from_group(group, "cuda")`` (``megatron/core/distributed/
torch_fully_sharded_data_parallel.py``, the FSDP adapters, ``fsdp_dtensor_checkpoint.py``, and
its dist-checkpointing tests). The string goes straight into torch, whose own code then
moves the mesh tensor ``.to("cuda")``: torch is not a framework module, so the scoped
translation never sees it and a CPU build fails with "Torch not compiled with CUDA
enabled". The device argument is the framework's, so it is translated where it enters
torch: ``DeviceMesh.__init__`` (``from_group`` and ``init_device_mesh`` construct through
it) gets the adapter's device type in place of ``"cuda"`` when a framework module is among
its callers (the constructor is reached from ``from_group`` one or two frames down).
Meshes made by anyone else keep what they asked for (no global lie).
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.translation.importer import caller_is_framework
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "mesh_init"]

#: frames above the constructor searched for a framework caller: from_group / init_device_mesh and torch's
#: own helpers between them and the framework's line
_DEPTHS = range(2, 8)


def _framework_called() -> bool:
    return any(caller_is_framework(d) for d in _DEPTHS)


def mesh_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``DeviceMesh.__init__``: ``device_type="cuda"`` from framework code -> the adapter's."""
    if args and isinstance(args[0], str) and args[0].startswith("cuda") and _framework_called():
        args = (get_accelerator().device_type,) + tuple(args[1:])
    elif (isinstance(kwargs.get("device_type"), str) and kwargs["device_type"].startswith("cuda")
          and _framework_called()):
        kwargs = dict(kwargs, device_type=get_accelerator().device_type)
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(name="megatron.core.device_mesh.device_type", target="torch.distributed.device_mesh:DeviceMesh.__init__",
          kind=WRAP, impl=mesh_init, distribution=DISTRIBUTION, versions=CORE, when=translated,
          reason="Megatron builds DeviceMesh.from_group(group, 'cuda'); torch then moves the mesh to 'cuda' in its own "
          "code, out of the translation's reach; a framework-built mesh gets the adapter's device type"),
]
