"""``torch.testdev``: the device module of the portspeed test device.

What ``torch._register_device_module`` installs and ``torch.get_device_module("testdev")``
returns: the per-device API torch and the frameworks expect of an accelerator module
(devices, generators, streams, memory, autocast dtypes), answered by the C++ extension and
by ``torch.accelerator``. It is a test device, not hardware: ``get_device_name()`` says so.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__ = [
    "is_available", "device_count", "current_device", "set_device", "device", "synchronize",
    "default_generators", "manual_seed", "manual_seed_all", "seed", "seed_all", "initial_seed",
    "get_rng_state", "set_rng_state", "get_rng_state_all", "set_rng_state_all",
    "Stream", "Event", "current_stream", "default_stream", "set_stream", "stream",
    "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
    "memory_stats", "reset_peak_memory_stats", "empty_cache", "mem_get_info",
    "is_bf16_supported", "get_amp_supported_dtype", "get_device_name", "get_device_properties",
    "get_device_capability", "is_initialized",
]

DEVICE_TYPE = "testdev"
_PRIVATEUSE1 = 20  # c10::DeviceType::PrivateUse1
_ext: Any = None  # set by portspeed.testing.testdev.runtime


def _index(dev: Any = None) -> int:
    if dev is None:
        return int(_ext.current_device())
    if isinstance(dev, int):
        return dev
    d = torch.device(dev)
    if d.type != DEVICE_TYPE:
        raise ValueError(f"expected a {DEVICE_TYPE!r} device, got {d}")
    return int(_ext.current_device()) if d.index is None else int(d.index)


# ---- devices
def is_available() -> bool:
    return True


def is_initialized() -> bool:
    return True


def _lazy_init() -> None:
    return None


def _is_in_bad_fork() -> bool:
    return False


def device_count() -> int:
    return int(_ext.device_count())


def current_device() -> int:
    return int(_ext.current_device())


def set_device(dev: Any) -> None:
    _ext.set_device(_index(dev))


class device:  # noqa: N801 - mirrors torch.cuda.device
    """Context manager that makes ``dev`` the current device."""

    def __init__(self, dev: Any) -> None:
        self.idx = _index(dev)
        self.prev = -1

    def __enter__(self) -> None:
        self.prev = current_device()
        _ext.set_device(self.idx)

    def __exit__(self, *exc: Any) -> None:
        _ext.set_device(self.prev)


def synchronize(dev: Any = None) -> None:
    torch.accelerator.synchronize(_index(dev))


def get_device_name(dev: Any = None) -> str:
    return f"portspeed test device {_index(dev)} (a test device, not hardware)"


class _DeviceProperties:
    """What torch.cuda.get_device_properties answers, for the test device (nominal figures)."""

    def __init__(self, index: int) -> None:
        self.name = get_device_name(index)
        self.total_memory = 16 << 30  # nominal, as mem_get_info reports
        self.major, self.minor = 0, 0  # no compute capability: not a CUDA device
        self.multi_processor_count = 1

    def __repr__(self) -> str:
        return f"_DeviceProperties(name={self.name!r}, total_memory={self.total_memory})"


def get_device_properties(dev: Any = None) -> _DeviceProperties:
    return _DeviceProperties(_index(dev))


def get_device_capability(dev: Any = None) -> tuple[int, int]:
    return (0, 0)


# ---- random numbers: one generator per device, separate from the host's
class _Generators:
    """``default_generators``: one Python object per device, made once (Megatron's RNG tracker
    gets and sets these states several times a step)."""

    def __init__(self) -> None:
        self._made: dict[int, torch.Generator] = {}

    def __getitem__(self, i: int) -> torch.Generator:
        gen = self._made.get(i)
        if gen is None:
            gen = self._made[int(i)] = _ext.default_generator(int(i))
        return gen

    def __len__(self) -> int:
        return device_count()

    def __iter__(self) -> Iterator[torch.Generator]:
        return (self[i] for i in range(len(self)))


default_generators = _Generators()


def manual_seed(seed: int) -> None:
    default_generators[current_device()].manual_seed(int(seed))


def manual_seed_all(seed: int) -> None:
    for g in default_generators:
        g.manual_seed(int(seed))


def seed() -> None:
    default_generators[current_device()].seed()


def seed_all() -> None:
    for g in default_generators:
        g.seed()


def initial_seed() -> int:
    return int(default_generators[current_device()].initial_seed())


def get_rng_state(dev: Any = DEVICE_TYPE) -> torch.Tensor:
    return default_generators[_index(dev)].get_state()


def set_rng_state(new_state: torch.Tensor, dev: Any = DEVICE_TYPE) -> None:
    default_generators[_index(dev)].set_state(new_state)


def get_rng_state_all() -> list[torch.Tensor]:
    return [g.get_state() for g in default_generators]


def set_rng_state_all(states: list[torch.Tensor]) -> None:
    for g, s in zip(default_generators, states):
        g.set_state(s)


# ---- streams and events (torch.Stream / torch.Event through the device guard)
def Stream(dev: Any = None, priority: int = 0, **kwargs: Any) -> torch.Stream:  # noqa: N802
    return torch.Stream(device=torch.device(DEVICE_TYPE, _index(dev)), priority=priority)


def Event(enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> torch.Event:  # noqa: N802
    return torch.Event(device=DEVICE_TYPE, enable_timing=enable_timing, blocking=blocking, interprocess=interprocess)


def current_stream(dev: Any = None) -> torch.Stream:
    return torch.accelerator.current_stream(_index(dev))


def default_stream(dev: Any = None) -> torch.Stream:
    # stream id 0 is the default stream of every device (the device guard's convention)
    return torch.Stream(stream_id=0, device_index=_index(dev), device_type=_PRIVATEUSE1)


def set_stream(s: torch.Stream) -> None:
    torch.accelerator.set_stream(s)


@contextlib.contextmanager
def stream(s: torch.Stream | None) -> Iterator[torch.Stream | None]:
    if s is None:
        yield s
        return
    prev = torch.accelerator.current_stream(s.device_index)
    torch.accelerator.set_stream(s)
    try:
        yield s
    finally:
        torch.accelerator.set_stream(prev)


# ---- memory
def memory_stats(dev: Any = None) -> dict[str, int]:
    return dict(_ext.memory_stats(_index(dev)))


def memory_allocated(dev: Any = None) -> int:
    return memory_stats(dev)["allocated_bytes.all.current"]


def max_memory_allocated(dev: Any = None) -> int:
    return memory_stats(dev)["allocated_bytes.all.peak"]


def memory_reserved(dev: Any = None) -> int:
    return memory_stats(dev)["reserved_bytes.all.current"]


def max_memory_reserved(dev: Any = None) -> int:
    return memory_stats(dev)["reserved_bytes.all.peak"]


def reset_peak_memory_stats(dev: Any = None) -> None:
    _ext.reset_peak_memory_stats(_index(dev))


def empty_cache() -> None:
    return None  # no caching allocator: freed memory is returned at once


def mem_get_info(dev: Any = None) -> tuple[int, int]:
    total = 16 << 30
    return total - memory_reserved(dev), total


# ---- dtypes
def is_bf16_supported(including_emulation: bool = True) -> bool:
    return True


def get_amp_supported_dtype() -> list[torch.dtype]:
    return [torch.bfloat16, torch.float16]
