"""Where adapters come from: the built-in table and the ``portspeed.adapters`` entry points.

Adding a vendor:

- *built-in* (shipped in this repository): a file in ``adapters/`` (installed as
  ``portspeed.adapters``), a line in ``BUILTIN_ADAPTERS`` below, and its place in
  ``DETECTION_ORDER`` (auto-detection tries the built-ins in that order; a vendor device
  goes before ``cuda`` when its torch build also answers ``torch.cuda``, and ``cpu`` stays
  last). Three edits, all in this package's data; no other module names an adapter.
- *third-party* (its own package; portspeed's test device is one): an entry point in the
  group ``ENTRY_POINT_GROUP`` naming the ``Accelerator`` subclass, and no line here.
  Entry-point adapters are auto-detected before every built-in (``selection``).

``docs/writing-an-adapter.md`` walks through both.
"""

from __future__ import annotations

import importlib
import importlib.metadata as _metadata
import sys
from typing import TYPE_CHECKING

from portspeed.errors import UnknownAcceleratorError

if TYPE_CHECKING:  # the contract (and torch with it) loads only when an adapter class is asked for
    from portspeed.accelerator.contract import Accelerator

__all__ = ["BUILTIN_ADAPTERS", "DETECTION_ORDER", "ENTRY_POINT_GROUP", "adapter_class", "available_adapters",
           "entry_point_adapters", "forget_entry_points"]

ENTRY_POINT_GROUP = "portspeed.adapters"

#: Built-in adapters: name -> "module:Class". A built-in vendor is its file, a line here and a place
#: in DETECTION_ORDER; a third-party adapter is an entry point and needs neither.
BUILTIN_ADAPTERS: dict[str, str] = {
    "cpu": "portspeed.adapters.cpu:CpuAccelerator",
    "cuda": "portspeed.adapters.cuda:CudaAccelerator",
    "npu": "portspeed.adapters.npu:NpuAccelerator",
    "xpu": "portspeed.adapters.xpu:XpuAccelerator",
    "mlu": "portspeed.adapters.mlu:MluAccelerator",
    "musa": "portspeed.adapters.musa:MusaAccelerator",
    "hpu": "portspeed.adapters.hpu:HpuAccelerator",
}

#: Auto-detection order of the built-ins (documented in the README); every built-in appears once.
DETECTION_ORDER: tuple[str, ...] = ("npu", "mlu", "musa", "hpu", "xpu", "cuda", "cpu")

#: (sys.path when scanned, adapters found): the entry-point scan reads the metadata of every
#: installed distribution, so it runs once per process and again only when sys.path changes
#: (or after reset_accelerator()).
_entry_points: tuple[tuple[str, ...], dict[str, _metadata.EntryPoint]] | None = None


def _entry_point_adapters() -> dict[str, _metadata.EntryPoint]:
    """Third-party adapters registered in ENTRY_POINT_GROUP, by name (cached per sys.path).

    Uses the standard library's importlib.metadata (the same code as the importlib-metadata
    backport, already loaded by torch): the backport's import pulls in email.policy, which
    alone costs more than the whole scan.
    """
    global _entry_points
    key = tuple(sys.path)
    cached = _entry_points
    if cached is not None and cached[0] == key:
        return dict(cached[1])
    try:
        eps = _metadata.entry_points(group=ENTRY_POINT_GROUP)
    except Exception:  # pragma: no cover - broken metadata must not stop selection
        return {}
    found = {ep.name: ep for ep in eps}
    _entry_points = (key, found)
    return dict(found)


def available_adapters() -> list[str]:
    """Every adapter name: built-ins, then entry points, sorted within each."""
    names = list(BUILTIN_ADAPTERS)
    names += sorted(n for n in _entry_point_adapters() if n not in BUILTIN_ADAPTERS)
    return names


def adapter_class(name: str) -> type[Accelerator]:
    """The adapter class registered under ``name`` (built-in or entry point)."""
    from portspeed.accelerator.contract import Accelerator

    if name in BUILTIN_ADAPTERS:
        modname, _, clsname = BUILTIN_ADAPTERS[name].partition(":")
        cls = getattr(importlib.import_module(modname), clsname)
    elif name in (eps := _entry_point_adapters()):
        cls = eps[name].load()
    else:
        raise UnknownAcceleratorError(
            f"unknown accelerator {name!r}; known adapters: {', '.join(available_adapters())}. "
            f"Third-party adapters register in the entry-point group {ENTRY_POINT_GROUP!r}."
        )
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise UnknownAcceleratorError(
            f"adapter {name!r} resolves to {cls!r}, which is not a portspeed.accelerator.Accelerator subclass"
        )
    return cls


def entry_point_adapters() -> dict[str, _metadata.EntryPoint]:
    """Third-party adapters by name (cached per sys.path)."""
    return _entry_point_adapters()


def forget_entry_points() -> None:
    """Drop the cached entry-point scan (the next lookup scans again)."""
    global _entry_points
    _entry_points = None
