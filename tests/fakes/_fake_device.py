"""A FAKE torch.cuda-like device module, the common part of every fake vendor.

``FakeDevice`` holds the state a real device runtime would (device count, current
device, per-device generators, current streams, allocator counters) and ``build_module``
turns it into a module with the torch.cuda function surface: ``is_available``,
``device_count``, ``current_device``, ``set_device``, ``synchronize``, ``default_generators``,
``get_rng_state``/``set_rng_state``/``manual_seed``/``manual_seed_all``/``initial_seed``,
``Stream``/``Event``/``current_stream``/``default_stream``/``stream``, the memory statistics
and ``get_device_properties``. Generators are CPU ``torch.Generator`` objects; nothing runs
on a device. Tests call ``fake_allocate``/``fake_free`` to move the allocator counters.

``install_modules`` puts modules into ``sys.modules`` and attributes onto ``torch`` and
returns an undo function, so a fake never outlives the test that installed it.

It exists only to check API names: the vendors' and the generic adapter's device-module
path (see tests/fakes/__init__.py); device semantics are checked on the test device, not here.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.machinery
import sys
import time
import types
from typing import Any, Callable, Iterator

import torch

__all__ = ["FakeDevice", "FakeStream", "FakeEvent", "new_module", "install_modules"]


class FakeStream:
    """A FAKE device stream: remembers its device and priority; work is already ordered."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device_index = 0 if device is None else _index(device)
        self.priority = priority
        self.waited_on: list[Any] = []

    def wait_stream(self, stream: Any) -> None:
        self.waited_on.append(stream)

    def wait_event(self, event: Any) -> None:
        self.waited_on.append(event)

    def record_event(self, event: "FakeEvent | None" = None) -> "FakeEvent":
        event = event or FakeEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return f"<FakeStream device={self.device_index} id={id(self):#x}>"


class FakeEvent:
    """A FAKE device event: ``record`` notes the host clock, ``elapsed_time`` is in ms."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self.enable_timing = enable_timing
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def query(self) -> bool:
        return self._t is not None

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: "FakeEvent") -> float:
        if not (self.enable_timing and end.enable_timing):
            raise RuntimeError("fake device: events were not created with enable_timing=True")
        if self._t is None or end._t is None:
            raise RuntimeError("fake device: both events must be recorded before elapsed_time()")
        return (end._t - self._t) * 1000.0


def _index(device: Any) -> int:
    if device is None:
        return -1
    if isinstance(device, int):
        return device
    if isinstance(device, torch.device):
        return 0 if device.index is None else device.index
    if isinstance(device, str):
        _, _, idx = device.partition(":")
        return int(idx) if idx else -1
    raise TypeError(f"fake device: cannot read a device index from {device!r}")


@dataclasses.dataclass
class FakeDevice:
    """State of a FAKE device runtime with ``count`` devices of type ``device_type``."""

    device_type: str
    count: int = 2
    available: bool = True
    bf16: bool | None = True  # None: the module has no is_bf16_supported()
    total_memory: int = 32 * 2**30
    current: int = 0
    synchronized: int = 0
    allocated: list[int] = dataclasses.field(default_factory=list)
    peak: list[int] = dataclasses.field(default_factory=list)
    generators: tuple[torch.Generator, ...] = ()
    streams: dict[int, FakeStream] = dataclasses.field(default_factory=dict)
    defaults: tuple[FakeStream, ...] = ()

    def __post_init__(self) -> None:
        self.allocated = [0] * self.count
        self.peak = [0] * self.count
        self.generators = tuple(torch.Generator() for _ in range(self.count))
        for g in self.generators:
            g.seed()
        self.defaults = tuple(FakeStream(i) for i in range(self.count))

    # -- what tests use to drive the fake --------------------------------------
    def fake_allocate(self, nbytes: int, device: int | None = None) -> None:
        i = self.resolve(device)
        self.allocated[i] += nbytes
        self.peak[i] = max(self.peak[i], self.allocated[i])

    def fake_free(self, nbytes: int, device: int | None = None) -> None:
        i = self.resolve(device)
        self.allocated[i] -= nbytes

    def resolve(self, device: Any) -> int:
        i = _index(device)
        i = self.current if i < 0 else i
        if not 0 <= i < self.count:
            raise RuntimeError(f"fake {self.device_type}: invalid device ordinal {i} (have {self.count})")
        return i

    # -- the module --------------------------------------------------------------
    def build_module(self, name: str) -> types.ModuleType:
        """A module named ``name`` exposing the torch.cuda-like surface over this state."""
        m = new_module(name, f"FAKE {self.device_type} device module (tests only; no device behind it).")
        funcs = {**self._device_functions(), **self._memory_functions()}
        if self.bf16 is not None:
            funcs["is_bf16_supported"] = lambda: bool(self.bf16)
        for k, v in funcs.items():
            setattr(m, k, v)
        m.default_generators = self.generators
        m.fake_state = self
        return m

    def _device_functions(self) -> dict[str, Callable[..., Any]]:
        """The device, RNG and stream part of the module."""
        st = self

        def set_device(device: Any) -> None:
            st.current = st.resolve(device)

        def get_rng_state(device: Any = st.device_type) -> torch.Tensor:
            return st.generators[st.resolve(device)].get_state()

        def set_rng_state(new_state: torch.Tensor, device: Any = st.device_type) -> None:
            st.generators[st.resolve(device)].set_state(new_state)

        def manual_seed_all(seed: int) -> None:
            for g in st.generators:
                g.manual_seed(int(seed))

        def synchronize(device: Any = None) -> None:
            st.resolve(device)
            st.synchronized += 1

        def current_stream(device: Any = None) -> FakeStream:
            i = st.resolve(device)
            return st.streams.get(i, st.defaults[i])

        @contextlib.contextmanager
        def stream(s: FakeStream | None) -> Iterator[FakeStream | None]:
            if s is None:
                yield None
                return
            prev = st.streams.get(s.device_index)
            st.streams[s.device_index] = s
            try:
                yield s
            finally:
                if prev is None:
                    st.streams.pop(s.device_index, None)
                else:
                    st.streams[s.device_index] = prev

        return {
            "is_available": lambda: st.available,
            "device_count": lambda: st.count if st.available else 0,
            "current_device": lambda: st.current,
            "set_device": set_device,
            "synchronize": synchronize,
            "get_rng_state": get_rng_state,
            "set_rng_state": set_rng_state,
            "manual_seed": lambda seed: st.generators[st.current].manual_seed(int(seed)),
            "manual_seed_all": manual_seed_all,
            "seed": lambda: st.generators[st.current].seed(),
            "initial_seed": lambda: st.generators[st.current].initial_seed(),
            "Stream": FakeStream,
            "Event": FakeEvent,
            "current_stream": current_stream,
            "default_stream": lambda device=None: st.defaults[st.resolve(device)],
            "stream": stream,
        }

    def _memory_functions(self) -> dict[str, Callable[..., Any]]:
        """The memory statistics and device properties part of the module."""
        st = self

        def memory_stats(device: Any = None) -> dict[str, int]:
            i = st.resolve(device)
            return {
                "allocated_bytes.all.current": st.allocated[i],
                "allocated_bytes.all.peak": st.peak[i],
                "reserved_bytes.all.current": st.allocated[i],
                "reserved_bytes.all.peak": st.peak[i],
            }

        def reset_peak_memory_stats(device: Any = None) -> None:
            i = st.resolve(device)
            st.peak[i] = st.allocated[i]

        def get_device_properties(device: Any = None) -> types.SimpleNamespace:
            st.resolve(device)
            return types.SimpleNamespace(name=f"FAKE {st.device_type}", total_memory=st.total_memory, has_fp64=True)

        return {
            "memory_allocated": lambda device=None: st.allocated[st.resolve(device)],
            "max_memory_allocated": lambda device=None: st.peak[st.resolve(device)],
            "memory_reserved": lambda device=None: st.allocated[st.resolve(device)],
            "max_memory_reserved": lambda device=None: st.peak[st.resolve(device)],
            "memory_stats": memory_stats,
            "reset_peak_memory_stats": reset_peak_memory_stats,
            "empty_cache": lambda: None,
            "get_device_properties": get_device_properties,
        }


def new_module(name: str, doc: str) -> types.ModuleType:
    """An empty module with a spec, so importlib.util.find_spec() answers for it like an installed one."""
    m = types.ModuleType(name, doc)
    m.__spec__ = importlib.machinery.ModuleSpec(name, loader=None, is_package=True)
    m.__path__ = []  # a package, so submodule imports resolve through sys.modules
    m.__file__ = f"<fake {name}>"
    return m


def install_modules(modules: dict[str, types.ModuleType], torch_attrs: dict[str, Any]) -> Callable[[], None]:
    """Put ``modules`` into sys.modules and ``torch_attrs`` onto torch; return the undo function."""
    saved_mods = {k: sys.modules.get(k) for k in modules}
    missing = object()
    saved_attrs = {k: getattr(torch, k, missing) for k in torch_attrs}
    sys.modules.update(modules)
    for k, v in torch_attrs.items():
        setattr(torch, k, v)
    torch.get_device_module.cache_clear()  # it caches per name; a vendor registers once, a fake comes and goes

    def undo() -> None:
        for k, v in saved_mods.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
        for k, v in saved_attrs.items():
            if v is missing:
                delattr(torch, k)
            else:
                setattr(torch, k, v)
        torch.get_device_module.cache_clear()

    return undo


@contextlib.contextmanager
def registered(
    device_type: str,
    devmod: types.ModuleType,
    modules: dict[str, types.ModuleType],
    register_device: bool,
) -> Iterator[None]:
    """Install a fake vendor: its modules, ``torch.<device_type>`` and ``sys.modules['torch.<device_type>']``.

    ``register_device=True`` also does what the real vendor packages do at import for an
    out-of-tree device: rename torch's PrivateUse1 device to ``device_type`` so that
    ``torch.device(device_type, i)`` parses. torch allows that once per process and cannot
    undo it, so only pass True in a throwaway subprocess.
    """
    if register_device:
        torch.utils.rename_privateuse1_backend(device_type)
    undo = install_modules({**modules, f"torch.{device_type}": devmod}, {device_type: devmod})
    try:
        yield
    finally:
        undo()
