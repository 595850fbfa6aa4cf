"""The device-abstraction contract every adapter implements, and how one is selected.

An adapter (one file per device in ``portspeed.adapters``) subclasses ``Accelerator``
and sets a few class attributes; the base class delegates everything else to the
device's torch module (``torch.cuda``, ``torch.npu``, ``torch.xpu``...), so a vendor
file stays small. The CPU adapter overrides what the CPU has no notion of (streams,
events, memory statistics) with honest null objects.

Selection (``get_accelerator``), first match wins:
1. an adapter injected with ``set_accelerator(obj)``;
2. ``PORTSPEED_ACCELERATOR=<name>``; an unknown name raises listing the known ones, a
   known adapter whose vendor package is missing raises naming the package to install;
3. auto-detection: third-party adapters from the entry-point group ``portspeed.adapters``,
   then the built-ins in ``DETECTION_ORDER`` (vendor devices that ship their own torch
   module first, since some of them also answer to ``torch.cuda``; then ``cuda``; ``cpu``
   always matches).

``PORTSPEED_BACKEND=<ccl>`` overrides the adapter's collective backend.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as _metadata
import importlib.util
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any, ClassVar, Iterator

import torch

from . import config
from .errors import ConfigError, MissingVendorPackageError, UnknownAcceleratorError

if TYPE_CHECKING:
    from .capabilities import BackendGaps, Capabilities

__all__ = [
    "Accelerator",
    "BUILTIN_ADAPTERS",
    "DETECTION_ORDER",
    "ENTRY_POINT_GROUP",
    "available_adapters",
    "adapter_class",
    "get_accelerator",
    "set_accelerator",
    "reset_accelerator",
    "selection_reason",
]

log = logging.getLogger("portspeed.accelerator")

ENTRY_POINT_GROUP = "portspeed.adapters"

#: Built-in adapters: name -> "module:Class". Adding a vendor is adding a file and a line here.
BUILTIN_ADAPTERS: dict[str, str] = {
    "cpu": "portspeed.adapters.cpu:CpuAccelerator",
    "cuda": "portspeed.adapters.cuda:CudaAccelerator",
    "npu": "portspeed.adapters.npu:NpuAccelerator",
    "xpu": "portspeed.adapters.xpu:XpuAccelerator",
    "mlu": "portspeed.adapters.mlu:MluAccelerator",
    "musa": "portspeed.adapters.musa:MusaAccelerator",
    "hpu": "portspeed.adapters.hpu:HpuAccelerator",
}

#: Auto-detection order of the built-ins (documented in the README).
DETECTION_ORDER: tuple[str, ...] = ("npu", "mlu", "musa", "hpu", "xpu", "cuda", "cpu")


class Accelerator:
    """One device family: its torch device, its collective backend, and device-runtime calls.

    Subclasses set ``name``, ``device_type``, ``backend`` and, for vendor devices,
    ``vendor_modules`` (import names that must load) and ``vendor_package`` (what to pip
    install), and declare what their backend lacks in ``backend_gaps``. Methods have
    working defaults that delegate to ``torch.<device_type>``; out-of-tree devices
    subclass ``portspeed.adapters.privateuse1.PrivateUse1Accelerator`` instead, which goes
    through ``torch.accelerator``. ``device()`` never returns None.
    """

    name: ClassVar[str] = ""
    device_type: ClassVar[str] = ""
    backend: ClassVar[str] = ""
    vendor_modules: ClassVar[tuple[str, ...]] = ()
    vendor_package: ClassVar[str | None] = None
    #: True for adapters whose hardware has been run in this project's own tests.
    verified_on_hardware: ClassVar[bool] = False
    #: What this adapter's own collective backend lacks (None: nothing beyond the built-in
    #: defaults of ``portspeed.capabilities``); the router rewrites what is listed.
    backend_gaps: ClassVar[BackendGaps | None] = None

    def __init__(self, backend: str | None = None) -> None:
        self._backend_override = backend

    # -- identity -------------------------------------------------------------
    @classmethod
    def vendor_installed(cls) -> bool:
        """Whether the vendor's torch extension can be imported (without importing it)."""
        return all(importlib.util.find_spec(m.split(".")[0]) is not None for m in cls.vendor_modules)

    @classmethod
    def load_vendor(cls) -> None:
        """Import the vendor modules, or raise MissingVendorPackageError naming the package."""
        for mod in cls.vendor_modules:
            try:
                importlib.import_module(mod)
            except ImportError as exc:
                raise MissingVendorPackageError(
                    f"the {cls.name!r} adapter needs the vendor package {cls.vendor_package or mod!r} "
                    f"(import {mod!r} failed: {exc}); install it, or pick another adapter with "
                    "PORTSPEED_ACCELERATOR (see `portspeed info`)"
                ) from exc

    @classmethod
    def detect(cls) -> bool:
        """Cheap check used by auto-detection: vendor package present and a device usable."""
        if cls.vendor_modules and not cls.vendor_installed():
            return False
        try:
            cls.load_vendor()
            return bool(cls().is_available())
        except Exception:  # detection must never crash selection
            return False

    @property
    def communication_backend(self) -> str:
        """The c10d backend collectives use on this device (PORTSPEED_BACKEND overrides)."""
        return self._backend_override or self.backend

    @property
    def module(self) -> Any:
        """The torch device module (``torch.cuda``, ``torch.npu``...)."""
        mod = getattr(torch, self.device_type, None)
        if mod is None:
            raise MissingVendorPackageError(
                f"torch has no 'torch.{self.device_type}' module; the {self.name!r} adapter needs "
                f"{self.vendor_package or 'a torch build with ' + self.device_type} installed and imported"
            )
        return mod

    # -- devices ----------------------------------------------------------------
    def is_available(self) -> bool:
        return bool(self.module.is_available())

    def device_count(self) -> int:
        return int(self.module.device_count())

    def current_device(self) -> int:
        return int(self.module.current_device())

    def set_device(self, index: int | str | torch.device) -> None:
        self.module.set_device(self._index(index))

    def device(self, index: int | None = None) -> torch.device:
        """A torch.device for ``index`` (default: the current device); never None."""
        return torch.device(self.device_type, self.current_device() if index is None else int(index))

    def synchronize(self, index: int | None = None) -> None:
        self.module.synchronize(index)

    def _index(self, index: int | str | torch.device | None) -> int:
        if index is None:
            return self.current_device()
        if isinstance(index, torch.device):
            return 0 if index.index is None else index.index
        if isinstance(index, str):
            dev = torch.device(index)
            return 0 if dev.index is None else dev.index
        return int(index)

    # -- random number generation ----------------------------------------------
    def default_generator(self, index: int | None = None) -> torch.Generator:
        """The generator ops on this device draw from (what Megatron forks per TP rank)."""
        return self.module.default_generators[self._index(index)]

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        return self.default_generator(index).get_state()

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        self.default_generator(index).set_state(state)

    def manual_seed(self, seed: int) -> None:
        self.default_generator().manual_seed(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        for i in range(max(1, self.device_count())):
            self.default_generator(i).manual_seed(int(seed))

    def initial_seed(self) -> int:
        return int(self.default_generator().initial_seed())

    # -- streams and events -----------------------------------------------------
    def Stream(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802 - mirrors torch.cuda.Stream
        return self.module.Stream(*args, **kwargs)

    def Event(self, *args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return self.module.Event(*args, **kwargs)

    def current_stream(self, index: int | None = None) -> Any:
        return self.module.current_stream(index)

    def default_stream(self, index: int | None = None) -> Any:
        return self.module.default_stream(index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self.module.stream(stream)

    # -- memory -------------------------------------------------------------------
    def memory_allocated(self, index: int | None = None) -> int:
        return int(self.module.memory_allocated(index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self.module.max_memory_allocated(index))

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self.module.memory_reserved(index))

    def max_memory_reserved(self, index: int | None = None) -> int:
        return int(self.module.max_memory_reserved(index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self.module.reset_peak_memory_stats(index)

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self.module.memory_stats(index))

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def total_memory(self, index: int | None = None) -> int:
        return int(self.module.get_device_properties(self._index(index)).total_memory)

    # -- dtypes -------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        fn = getattr(self.module, "is_bf16_supported", None)
        return bool(fn()) if fn else True

    def is_fp16_supported(self) -> bool:
        return True

    def is_fp64_supported(self) -> bool:
        """Whether float64 tensors compute in float64 here (some devices lack or downcast it)."""
        return True

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float32]
        if self.is_fp16_supported():
            out.append(torch.float16)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        if self.is_fp64_supported():
            out.append(torch.float64)
        return out

    # -- profiling ranges ---------------------------------------------------------
    def range_push(self, msg: str) -> None:
        nvtx = getattr(self.module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_push(msg)

    def range_pop(self) -> None:
        nvtx = getattr(self.module, "nvtx", None)
        if nvtx is not None:
            nvtx.range_pop()

    # -- collectives --------------------------------------------------------------
    @classmethod
    def default_backend(cls) -> str:
        """The backend this adapter uses when PORTSPEED_BACKEND does not override it."""
        return cls.backend

    def owns_backend(self, backend: str) -> bool:
        """Whether ``backend`` is this adapter's own, the one ``backend_gaps`` describes."""
        return backend.lower() == self.default_backend().lower()

    def capabilities(self, backend: str | None = None) -> Capabilities:
        """What ``backend`` (default: this adapter's) lacks: the router's table for its groups.

        The built-in defaults (``capabilities_for``: Gloo by torch release, NCCL), plus
        ``backend_gaps`` when ``backend`` is this adapter's own.
        """
        from .capabilities import capabilities_for

        name = (backend or self.communication_backend).lower()
        if self.backend_gaps is not None and self.owns_backend(name):
            return self.backend_gaps.capabilities(name, adapter=self.name)
        return capabilities_for(name)

    def describe(self) -> dict[str, Any]:
        """A summary for `portspeed info` and loss records."""
        return {
            "name": self.name,
            "device_type": self.device_type,
            "backend": self.communication_backend,
            "vendor_package": self.vendor_package,
            "verified_on_hardware": self.verified_on_hardware,
        }

    def __repr__(self) -> str:
        return f"<{type(self).__name__} name={self.name!r} backend={self.communication_backend!r}>"


# ---------------------------------------------------------------------- registry
_lock = threading.RLock()
_selected: Accelerator | None = None
_reason: str = ""


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


def _backend_override() -> str | None:
    b = config.settings().backend
    if b is None:
        return None
    from .capabilities import check_backend_name
    from .errors import UnknownBackendError

    try:
        check_backend_name(b)
    except UnknownBackendError as exc:
        raise ConfigError(f"PORTSPEED_BACKEND={b!r} is not usable: {exc}") from exc
    return b


def _make(name: str, reason: str) -> Accelerator:
    cls = adapter_class(name)
    cls.load_vendor()
    acc = cls(backend=_backend_override())
    global _reason
    _reason = reason
    return acc


def get_accelerator() -> Accelerator:
    """The active adapter (selected once per process; see the module docstring for the order)."""
    global _selected
    if _selected is not None:
        return _selected
    with _lock:
        if _selected is not None:
            return _selected
        requested = config.settings().accelerator
        if requested:
            _selected = _make(requested, "PORTSPEED_ACCELERATOR")
            return _selected
        eps = _entry_point_adapters()
        for name in sorted(eps):
            if name in BUILTIN_ADAPTERS:
                continue
            try:
                cls = adapter_class(name)
                if cls.detect():
                    _selected = _make(name, f"auto-detected (entry point {name!r})")
                    return _selected
            except Exception as exc:
                log.warning("portspeed: adapter entry point %r failed to load: %s", name, exc)
        for name in DETECTION_ORDER:
            cls = adapter_class(name)
            if cls.detect():
                _selected = _make(name, "auto-detected")
                return _selected
        raise UnknownAcceleratorError("no adapter detected, not even 'cpu'")  # pragma: no cover


def set_accelerator(accelerator: Accelerator) -> None:
    """Inject an adapter instance (the official hook, like DeepSpeed's set_accelerator)."""
    global _selected, _reason
    if not isinstance(accelerator, Accelerator):
        raise TypeError(f"set_accelerator() takes an Accelerator instance, got {type(accelerator).__name__}")
    with _lock:
        _selected = accelerator
        _reason = "set_accelerator()"


def reset_accelerator() -> None:
    """Forget the selection and the entry-point scan (tests); the next get_accelerator() selects again."""
    global _selected, _reason, _entry_points
    with _lock:
        _selected = None
        _reason = ""
        _entry_points = None


def selection_reason() -> str:
    """Why the active adapter was chosen ('' before selection)."""
    return _reason
