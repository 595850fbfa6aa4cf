"""The CPU adapter: Gloo collectives, the CPU generator, null streams and events.

The CPU has no streams, events or caching allocator. Stream and event objects here are
null objects whose waits and synchronizations return at once (CPU ops run in program
order), and memory statistics are 0: honest answers, not guesses.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import torch

from portspeed.vendor import Accelerator

__all__ = ["CpuAccelerator", "NullStream", "NullEvent"]


class NullStream:
    """A stream on a device without streams: every operation is already ordered."""

    def __init__(self, device: Any = None, priority: int = 0, **_: Any) -> None:
        self.device = torch.device("cpu")
        self.priority = priority

    def wait_stream(self, stream: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record_event(self, event: Any = None) -> "NullEvent":
        event = event or NullEvent()
        event.record(self)
        return event

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def __enter__(self) -> "NullStream":
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NullStream)

    def __hash__(self) -> int:
        return hash(NullStream)


class NullEvent:
    """An event on a device without asynchronous execution; elapsed_time uses wall clock."""

    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False) -> None:
        self._t: float | None = None

    def record(self, stream: Any = None) -> None:
        self._t = time.perf_counter()

    def wait(self, stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: "NullEvent") -> float:
        if self._t is None or end._t is None:
            raise RuntimeError("elapsed_time() needs both events recorded")
        return (end._t - self._t) * 1000.0


_DEFAULT_STREAM = NullStream()


class CpuAccelerator(Accelerator):
    """Plain CPU with Gloo: the accelerator every machine has, and portspeed's reference."""

    name = "cpu"
    device_type = "cpu"
    backend = "gloo"
    device_is_host = True
    verified_on_hardware = True

    def __init__(self, backend: str | None = None) -> None:
        super().__init__(backend)
        self._current = 0

    def is_available(self) -> bool:
        return True

    def device_count(self) -> int:
        return 1

    def current_device(self) -> int:
        return self._current

    def set_device(self, index: int | str | torch.device) -> None:
        # Every rank on a host shares "the" CPU; remember the index framework code asked for
        # (Megatron sets LOCAL_RANK) but place tensors on the single CPU device.
        self._current = self._index(index)

    def device(self, index: int | None = None) -> torch.device:
        return torch.device("cpu")

    def synchronize(self, index: int | None = None) -> None:
        pass

    def default_generator(self, index: int | None = None) -> torch.Generator:
        return torch.default_generator

    def manual_seed_all(self, seed: int) -> None:
        torch.default_generator.manual_seed(int(seed))

    def Stream(self, *args: Any, **kwargs: Any) -> NullStream:  # noqa: N802
        return NullStream(*args, **kwargs)

    def Event(self, *args: Any, **kwargs: Any) -> NullEvent:  # noqa: N802
        return NullEvent(*args, **kwargs)

    def current_stream(self, index: int | None = None) -> NullStream:
        return _DEFAULT_STREAM

    def default_stream(self, index: int | None = None) -> NullStream:
        return _DEFAULT_STREAM

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        """A no-op block; re-enterable like ``torch.cuda.StreamContext`` (Megatron's DDP enters one twice)."""
        return contextlib.nullcontext(stream)

    def memory_allocated(self, index: int | None = None) -> int:
        return 0

    def max_memory_allocated(self, index: int | None = None) -> int:
        return 0

    def memory_reserved(self, index: int | None = None) -> int:
        return 0

    def max_memory_reserved(self, index: int | None = None) -> int:
        return 0

    def reset_peak_memory_stats(self, index: int | None = None) -> None:
        pass

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return {}

    def empty_cache(self) -> None:
        pass

    def total_memory(self, index: int | None = None) -> int:
        import os

        try:
            return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
            return 0

    def is_bf16_supported(self) -> bool:
        return True

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass
