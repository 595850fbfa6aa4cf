"""The generic adapter for any out-of-tree (PrivateUse1) or ``torch.accelerator`` device.

Why: a vendor that plugs into PyTorch the documented way registers a device type (often
by renaming PrivateUse1), a device module (``torch._register_device_module``, so that
``torch.get_device_module(<type>)`` answers) and a c10d backend for its device type
(``Backend.register_backend(..., devices=[<type>])``). Everything portspeed needs can be
read from those three, so a vendor adapter is a subclass that sets names only (vendors import it
from ``portspeed.vendor``)::

    class AcmeAccelerator(PrivateUse1Accelerator):
        name = "acme"
        device_type = "acme"
        vendor_modules = ("torch_acme",)
        vendor_package = "torch-acme"
        backend_gaps = BackendGaps(unsupported_ops=[dist.ReduceOp.AVG])

Contract
- **Runtime.** When torch's C++ runtime serves the device (``torch.accelerator`` reports it
  as the current accelerator and answers ``current_device_index()``), devices, synchronize,
  streams (``torch.Stream(device=...)``), events (``torch.Event``) and memory statistics go
  through ``torch.accelerator``. Otherwise (a vendor bridge that only ships a Python module,
  or the test fakes) the same calls go to the device module. No line names a device.
- **RNG** goes through the device module: its ``manual_seed``/``get_rng_state``/
  ``set_rng_state`` functions, and its ``default_generators`` for ``default_generator()``;
  a module without generator objects gets a ``ModuleGenerator`` view over those functions.
- **Backend.** ``backend`` may stay empty: the adapter then uses what the vendor registered
  for its device type in ``torch.distributed.Backend.default_device_backend_map``.
- **Detection.** ``detect()`` is the base check (vendor package present, device available)
  unless ``auto_detect`` is False: a test device sets that, so it is chosen only by name.

Limits: ``default_stream()`` needs the device module's ``default_stream`` (``torch.accelerator``
has none); a call the device offers neither way raises UnsupportedCudaCallError naming it.
"""

from __future__ import annotations

import contextlib
from types import ModuleType
from typing import Any, ClassVar, Iterator

import torch

from portspeed.accelerator.contract import Accelerator
from portspeed.errors import MissingVendorPackageError, UnknownBackendError, UnsupportedCudaCallError

__all__ = ["ModuleGenerator", "PrivateUse1Accelerator", "registered_backend"]

#: torch.accelerator memory functions, used when torch's allocator serves the device
_MEMORY_FUNCTIONS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                     "memory_stats", "reset_peak_memory_stats")


def registered_backend(device_type: str) -> str | None:
    """The c10d backend registered for ``device_type`` (``Backend.default_device_backend_map``), or None."""
    import torch.distributed as dist

    if not dist.is_available():
        return None
    return dist.Backend.default_device_backend_map.get(device_type)


def _runtime_serves(device_type: str) -> bool:
    """Whether torch.accelerator answers for ``device_type`` (its C++ runtime is registered)."""
    try:
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != device_type:
            return False
        torch.accelerator.current_device_index()  # raises when torch has no device guard for it
        return True
    except RuntimeError:
        return False


class ModuleGenerator:
    """A torch.Generator-like view of one device's generator, for device modules without generator objects.

    It seeds, saves and restores through the module's functions. It cannot be passed as
    ``generator=`` to torch ops (only a real torch.Generator can).
    """

    def __init__(self, adapter: "PrivateUse1Accelerator", index: int) -> None:
        self._acc, self._index = adapter, index
        self.device = adapter.device(index)

    @contextlib.contextmanager
    def _current(self) -> Iterator[ModuleType]:
        prev = self._acc.current_device()
        self._acc.set_device(self._index)
        try:
            yield self._acc.module
        finally:
            self._acc.set_device(prev)

    def manual_seed(self, seed: int) -> "ModuleGenerator":
        with self._current() as mod:
            mod.manual_seed(int(seed))
        return self

    def seed(self) -> int:
        with self._current() as mod:
            mod.seed()
            return int(mod.initial_seed())

    def initial_seed(self) -> int:
        with self._current() as mod:
            return int(mod.initial_seed())

    def get_state(self) -> torch.Tensor:
        return self._acc.module.get_rng_state(self._index)

    def set_state(self, state: torch.Tensor) -> "ModuleGenerator":
        self._acc.module.set_rng_state(state, self._index)
        return self


class PrivateUse1Accelerator(Accelerator, abstract=True):
    """Any device torch knows through ``torch.accelerator`` and ``torch.get_device_module``.

    An intermediate base (``abstract=True``): a subclass sets ``name`` and ``device_type``; its
    backend defaults to the one the vendor registered for the device type.
    """

    #: False: never auto-detected, chosen only by name (PORTSPEED_ACCELERATOR), e.g. a test device.
    auto_detect: ClassVar[bool] = True

    # -- identity -----------------------------------------------------------------
    @classmethod
    def detect(cls) -> bool:
        """The base check (vendor package present, a device available), unless auto_detect is False."""
        return bool(cls.auto_detect) and super().detect()

    @classmethod
    def default_backend(cls) -> str:
        """``backend`` if set, else what the vendor registered for ``device_type``."""
        if cls.backend:
            return cls.backend
        found = registered_backend(cls.device_type)
        if found is None:
            raise UnknownBackendError(
                f"the {cls.name!r} adapter names no backend and none is registered for device type "
                f"{cls.device_type!r} in torch.distributed.Backend.default_device_backend_map; import the vendor "
                "package (it registers its backend), set `backend` on the adapter, or set PORTSPEED_BACKEND"
            )
        return found

    @property
    def communication_backend(self) -> str:
        """The c10d backend collectives use on this device (PORTSPEED_BACKEND overrides)."""
        return self._backend_override or self.default_backend()

    @property
    def module(self) -> Any:
        """``torch.get_device_module(device_type)``: the module the vendor registered."""
        try:
            return torch.get_device_module(self.device_type)
        except RuntimeError as exc:
            # A bridge that sets torch.<type> before its device type parses (the test fakes do)
            mod = getattr(torch, self.device_type, None)
            if mod is not None:
                return mod
            raise MissingVendorPackageError(
                f"torch has no device module for {self.device_type!r} ({exc}); the {self.name!r} adapter needs "
                f"{self.vendor_package or 'the vendor package that registers it'} installed and imported"
            ) from exc

    def _runtime(self) -> bool:
        served = self.__dict__.get("_served")
        if served is None:
            served = self.__dict__["_served"] = _runtime_serves(self.device_type)
        return served

    def _need(self, fn: str) -> Any:
        found = getattr(self.module, fn, None)
        if found is None:
            raise UnsupportedCudaCallError(
                f"the {self.name!r} adapter: torch.accelerator does not serve device type {self.device_type!r} and "
                f"its device module has no {fn}(); override {type(self).__name__}.{fn} in the adapter"
            )
        return found

    # -- devices ----------------------------------------------------------------------
    def device_count(self) -> int:
        return int(torch.accelerator.device_count() if self._runtime() else self.module.device_count())

    def current_device(self) -> int:
        return int(torch.accelerator.current_device_index() if self._runtime() else self.module.current_device())

    def set_device(self, index: int | str | torch.device) -> None:
        if self._runtime():
            torch.accelerator.set_device_index(self._index(index))
        else:
            self.module.set_device(self._index(index))

    def synchronize(self, index: int | None = None) -> None:
        if self._runtime():
            torch.accelerator.synchronize(index)
        else:
            self.module.synchronize(index)

    # -- random number generation -------------------------------------------------------
    def default_generator(self, index: int | None = None) -> Any:
        """The device module's generator for ``index``, or a ModuleGenerator view when it has none (the host's
        default generator where the adapter declares ``host_generator``: the one its random ops draw from)."""
        if self.host_generator:
            return torch.default_generator
        gens = getattr(self.module, "default_generators", None)
        if gens is not None:
            return gens[self._index(index)]
        return ModuleGenerator(self, self._index(index))

    def get_rng_state(self, index: int | None = None) -> torch.Tensor:
        if self.host_generator:
            return torch.default_generator.get_state()
        return self._need("get_rng_state")(self._index(index))

    def set_rng_state(self, state: torch.Tensor, index: int | None = None) -> None:
        if self.host_generator:
            torch.default_generator.set_state(state)
            return
        self._need("set_rng_state")(state, self._index(index))

    def manual_seed(self, seed: int) -> None:
        if self.host_generator:
            torch.default_generator.manual_seed(int(seed))
            return
        self._need("manual_seed")(int(seed))

    def manual_seed_all(self, seed: int) -> None:
        if self.host_generator:
            torch.default_generator.manual_seed(int(seed))
            return
        fn = getattr(self.module, "manual_seed_all", None)
        if fn is not None:
            fn(int(seed))
        else:
            super().manual_seed_all(seed)

    def initial_seed(self) -> int:
        if self.host_generator:
            return int(torch.default_generator.initial_seed())
        return int(self._need("initial_seed")())

    # -- streams and events ---------------------------------------------------------------
    def Stream(self, device: Any = None, priority: int = 0, **kwargs: Any) -> Any:  # noqa: N802
        if self._runtime():
            return torch.Stream(device=self.device(None if device is None else self._index(device)), priority=priority)
        return self.module.Stream(device, priority=priority, **kwargs)

    def Event(  # noqa: N802
            self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> Any:
        if self._runtime():
            return torch.Event(device=self.device_type, enable_timing=enable_timing, blocking=blocking,
                               interprocess=interprocess)
        return self.module.Event(enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)

    def current_stream(self, index: int | None = None) -> Any:
        if self._runtime():
            return torch.accelerator.current_stream(index)
        return self.module.current_stream(index)

    def default_stream(self, index: int | None = None) -> Any:
        return self._need("default_stream")(index)

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """Make ``stream`` current inside the block (None: no change), restoring stream and device after."""
        if not self._runtime():
            return self.module.stream(stream)
        return _AcceleratorStream(self, stream)

    # -- memory ----------------------------------------------------------------------------
    def _accelerator_memory(self) -> bool:
        """Whether torch.accelerator's memory functions serve this device (its allocator is torch's kind)."""
        ok = self.__dict__.get("_memory_ok")
        if ok is None:
            ok = self._runtime() and all(hasattr(torch.accelerator, f) for f in _MEMORY_FUNCTIONS)
            if ok:
                try:
                    torch.accelerator.memory_stats(self.current_device())
                except RuntimeError:  # the device's allocator is not a c10 DeviceAllocator
                    ok = False
            self.__dict__["_memory_ok"] = ok
        return ok

    def _memory(self, fn: str, index: int | None) -> Any:
        if self._accelerator_memory():
            return getattr(torch.accelerator, fn)(self._index(index))
        return self._need(fn)(index)

    def memory_allocated(self, index: int | None = None) -> int:
        return int(self._memory("memory_allocated", index))

    def max_memory_allocated(self, index: int | None = None) -> int:
        return int(self._memory("max_memory_allocated", index))

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self._memory("memory_reserved", index))

    def max_memory_reserved(self, index: int | None = None) -> int:
        return int(self._memory("max_memory_reserved", index))

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        self._memory("reset_peak_memory_stats", index)

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self._memory("memory_stats", index))

    def empty_cache(self) -> None:
        if self._accelerator_memory() and hasattr(torch.accelerator, "empty_cache"):
            torch.accelerator.empty_cache()
        else:
            self._need("empty_cache")()

    def device_total_memory(self, index: int | None = None) -> int:
        """What the device answers: torch.accelerator.get_memory_info, else the module's properties or mem_get_info
        (raises where it cannot say; ``total_memory`` then degrades to a stated value)."""
        i = self._index(index)
        if self._accelerator_memory() and hasattr(torch.accelerator, "get_memory_info"):
            return int(torch.accelerator.get_memory_info(i)[1])
        props = getattr(self.module, "get_device_properties", None)
        if props is not None:
            return int(props(i).total_memory)
        return int(self._need("mem_get_info")(i)[1])

    def __repr__(self) -> str:
        try:
            backend = self.communication_backend
        except UnknownBackendError:
            backend = None
        return f"<{type(self).__name__} name={self.name!r} device_type={self.device_type!r} backend={backend!r}>"


class _AcceleratorStream:
    """``stream`` current inside the block through ``torch.accelerator``, then the previous stream and device.

    A class, not a generator: like ``torch.cuda.StreamContext`` the same object may be entered
    again after it exits (Megatron's DDP enters one ``stream_context`` twice per grad sync).
    """

    def __init__(self, acc: Any, stream: Any) -> None:
        self.acc, self.stream, self.saved = acc, stream, []

    def __enter__(self) -> Any:
        if self.stream is not None:
            self.saved.append((self.acc.current_device(), torch.accelerator.current_stream(self.stream.device_index)))
            torch.accelerator.set_stream(self.stream)  # also makes the stream's device current
        return self.stream

    def __exit__(self, *exc: Any) -> None:
        if self.stream is not None:
            device, prev = self.saved.pop()
            torch.accelerator.set_stream(prev)
            torch.accelerator.set_device_index(device)
