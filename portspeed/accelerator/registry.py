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
- *not packaged* (a vendor trying a device): ``module:Class`` (an importable module) or
  ``path/to/file.py:Class`` wherever an adapter name goes (``PORTSPEED_ACCELERATOR``,
  ``portspeed conformance --adapter``, ``portspeed info --adapter``). A file is imported once per
  process under a name made from its absolute path (``adapter_module_name``), so every lookup gets
  the same class; a relative path is taken from the working directory, which is why the launchers
  make it absolute for their workers (``preflight.check_settings``).

``docs/writing-an-adapter.md`` walks through both.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata as _metadata
import importlib.util
import os
import re
import sys
from types import ModuleType
from typing import TYPE_CHECKING

from portspeed.accelerator.declarations import WRITTEN_AS, class_label
from portspeed.errors import UnknownAcceleratorError

if TYPE_CHECKING:  # the contract (and torch with it) loads only when an adapter class is asked for
    from portspeed.accelerator.contract import Accelerator

__all__ = ["BUILTIN_ADAPTERS", "DETECTION_ORDER", "ENTRY_POINT_GROUP", "adapter_class", "adapter_module_name",
           "available_adapters", "entry_point_adapters", "forget_entry_points", "is_spec"]

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


def is_spec(name: str) -> bool:
    """Whether ``name`` is ``module:Class`` or ``path/to/file.py:Class`` rather than an adapter's name."""
    return ":" in name


def adapter_module_name(path: str) -> str:
    """The module name an adapter file is imported under: its stem and a digest of its absolute path."""
    path = os.path.abspath(path)
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    return f"portspeed_adapter_file_{stem}_{hashlib.sha1(path.encode()).hexdigest()[:8]}"


def _import_file(spec: str, path: str) -> ModuleType:
    """Import the adapter file ``path`` once per process (later lookups get the same module)."""
    name = adapter_module_name(path)
    if name in sys.modules:
        return sys.modules[name]
    if not os.path.isfile(path):
        raise UnknownAcceleratorError(f"adapter {spec!r}: the file {path!r} does not exist (a relative path is taken "
                                      "from the directory the command was started in)")
    found = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(found)  # type: ignore[arg-type]
    setattr(module, WRITTEN_AS, spec.rpartition(":")[0])  # messages name its classes as the user wrote them
    sys.modules[name] = module  # before it runs, as an import does (dataclasses and pickling look it up)
    try:
        found.loader.exec_module(module)  # type: ignore[union-attr]
    except BaseException:
        sys.modules.pop(name, None)
        raise
    return module


def _load(spec: str) -> object:
    """The object ``module:Class`` or ``file.py:Class`` names; a portspeed error naming what is missing."""
    from portspeed.accelerator.contract import AdapterContractError

    target, _, qualname = spec.rpartition(":")
    try:
        if target.endswith(".py"):
            module = _import_file(spec, os.path.abspath(target))
        else:
            module = importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and (target == exc.name or target.startswith(exc.name + ".")):
            raise UnknownAcceleratorError(f"adapter {spec!r}: no module named {exc.name!r} (check the spelling and "
                                          "that it is installed or on PYTHONPATH; a file is written "
                                          "path/to/file.py:Class)"
                                          ) from None
        raise UnknownAcceleratorError(f"adapter {spec!r}: importing {target!r} failed: {exc}") from exc
    except AdapterContractError as exc:
        raise AdapterContractError(f"adapter {spec!r}: {exc}") from None
    except UnknownAcceleratorError:
        raise
    except Exception as exc:  # the vendor's own module failed: one line, naming it
        raise UnknownAcceleratorError(f"adapter {spec!r}: importing {target!r} failed: "
                                      f"{type(exc).__name__}: {exc}") from exc
    obj: object = module
    for part in qualname.split("."):
        if not hasattr(obj, part):
            from portspeed.accelerator.contract import Accelerator

            defined = sorted(k for k, v in vars(module).items() if isinstance(v, type) and issubclass(v, Accelerator)
                             and v.__module__ == module.__name__)
            raise UnknownAcceleratorError(
                f"adapter {spec!r}: {target!r} has no {qualname!r}; the adapter classes it defines: "
                f"{', '.join(defined) or 'none'}")
        obj = getattr(obj, part)
    return obj


#: spec (a file made absolute) -> (its module's name, that module, the object): loaded once per process, as long
#: as the module is the one in sys.modules (a test that replaces the module gets its new class)
_loaded: dict[str, tuple[str, ModuleType, object]] = {}


def _load_once(spec: str) -> object:
    """``_load(spec)``, once per process for each spec (``file.py:Class`` keyed by its absolute path)."""
    target, _, qualname = spec.rpartition(":")
    modname = target
    if target.endswith(".py"):
        modname = adapter_module_name(target)
        key = f"{os.path.abspath(target)}:{qualname}"
    else:
        key = spec
    hit = _loaded.get(key)
    if hit is not None and sys.modules.get(hit[0]) is hit[1]:
        return hit[2]
    obj = _load(spec)
    module = sys.modules.get(modname)
    if module is not None:
        _loaded[key] = (modname, module, obj)
    return obj


def adapter_class(name: str) -> type[Accelerator]:
    """The adapter class registered under ``name`` (built-in or entry point), or named by ``module:Class`` /
    ``path/to/file.py:Class``; checked against the contract (``contract.check_adapter``)."""
    from portspeed.accelerator.contract import Accelerator, AdapterContractError, check_adapter

    if is_spec(name):
        cls = _load_once(name)
    elif name in BUILTIN_ADAPTERS:
        modname, _, clsname = BUILTIN_ADAPTERS[name].partition(":")
        cls = getattr(importlib.import_module(modname), clsname)
    elif name in (eps := _entry_point_adapters()):
        cls = eps[name].load()
    else:
        raise UnknownAcceleratorError(
            f"unknown accelerator {name!r}; known adapters: {', '.join(available_adapters())}. "
            f"Third-party adapters register in the entry-point group {ENTRY_POINT_GROUP!r}, or are named "
            "as module:Class or path/to/file.py:Class."
        )
    if not (isinstance(cls, type) and issubclass(cls, Accelerator)):
        raise UnknownAcceleratorError(
            f"adapter {name!r}: it names {class_label(cls) if isinstance(cls, type) else repr(cls)}, which is not a "
            "portspeed.vendor.Accelerator subclass"
        )
    try:
        check_adapter(cls)  # an abstract base, or a class whose members were emptied after it was defined
    except AdapterContractError as exc:
        raise AdapterContractError(f"adapter {name!r}: {exc}") from None
    return cls


def entry_point_adapters() -> dict[str, _metadata.EntryPoint]:
    """Third-party adapters by name (cached per sys.path)."""
    return _entry_point_adapters()


def forget_entry_points() -> None:
    """Drop the cached entry-point scan (the next lookup scans again)."""
    global _entry_points
    _entry_points = None
