"""The adaptors and the patch sets, named once: what `portspeed run` launches, `portspeed patches` lists
and `portspeed info` gates.

Layer: integrations. The command line and the conformance kit reach ``portspeed.patches``
only through this table, so the integrations stay the one layer that imports patch
modules; a patch module is loaded when its set is asked for, never at import.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portspeed.patching.record import Patch

__all__ = ["ADAPTORS", "PATCH_SETS", "load", "megatron_fingerprints"]

#: short adaptor name -> the public module a script (or a `portspeed run` worker) imports
ADAPTORS: dict[str, str] = {
    "megatron": "portspeed.megatron_adaptor",
    "deepspeed": "portspeed.deepspeed_adaptor",
}

#: patch set -> (module, attribute holding the list or a function returning it)
PATCH_SETS: dict[str, tuple[str, str]] = {
    "torch_cuda": ("portspeed.patches.torch_cuda", "PATCHES"),
    "torch_distributed": ("portspeed.patches.torch_distributed", "PATCHES"),
    "megatron": ("portspeed.patches.megatron", "all_patches"),
    "deepspeed": ("portspeed.patches.deepspeed", "PATCHES"),
    "hf_accelerate": ("portspeed.patches.hf_accelerate", "PATCHES"),
    # declared only when PORTSPEED_PROBE_DIR is set (probing off: an empty set, nothing installed)
    "probe": ("portspeed.patches.probe", "all_patches"),
    # declared only when PORTSPEED_PERF is set (off: an empty set, nothing installed)
    "perf": ("portspeed.patches.perf", "all_patches"),
}


def load(name: str) -> list[Patch]:
    """The patches of set ``name`` (imports its patch module; a framework it imports at top level loads too)."""
    try:
        module, attr = PATCH_SETS[name]
    except KeyError:
        raise KeyError(f"unknown patch set {name!r}; known: {', '.join(PATCH_SETS)}") from None
    value = getattr(importlib.import_module(module), attr)
    return list(value() if callable(value) else value)


def megatron_fingerprints() -> ModuleType:
    """The module recording each Megatron patch's target fingerprint per release (`portspeed patches --check`)."""
    return importlib.import_module("portspeed.patches.megatron.fingerprints")
