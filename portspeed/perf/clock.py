"""The clock a perf recording reads: the device's own timing events where it has them, else the host's.

Why events: a module's time on an asynchronous device is when its kernels ran, not when the host queued
them, and reading it must not stall the device per module. An ``EventClock`` records one timing event
(``Accelerator.Event(enable_timing=True)``, through the active adapter) on the current stream at each
boundary and reads them all once, at the iteration's end, after one wait on the last event. On a device
that is the host (the CPU adapter) the host clock is the device's clock (``HostClock``). A device whose
adapter makes no timing events gets the host clock with one synchronize at each iteration boundary
(``clock.kind == "host-synchronized"``): module times are then when the host queued the work, which the
recording says (``describe()``), so a reader knows not to trust them per module.

    clock = make_clock()
    a = clock.stamp(); ...; b = clock.stamp()
    ms = clock.resolve([a, b])      # milliseconds since the first stamp of the iteration, once per iteration
"""

from __future__ import annotations

import time
from typing import Any, Sequence

__all__ = ["Clock", "EventClock", "HostClock", "make_clock"]


class Clock:
    """A stamp per boundary; ``resolve`` turns an iteration's stamps into milliseconds from the first one."""

    kind = "host"
    note = ""

    def start(self) -> None:
        """The iteration begins (a synchronizing clock waits for the device here)."""

    def stamp(self) -> Any:
        raise NotImplementedError

    def resolve(self, stamps: Sequence[Any]) -> list[float]:
        raise NotImplementedError

    def describe(self) -> dict[str, str]:
        """What the recording says about its clock."""
        return {"clock": self.kind, "clock_note": self.note}


class HostClock(Clock):
    """``time.perf_counter``: the device is the host (or has no events, and is synchronized per iteration)."""

    def __init__(self, kind: str = "host", note: str = "the device is the host: host time is device time",
                 sync: Any = None) -> None:
        self.kind, self.note, self._sync = kind, note, sync

    def start(self) -> None:
        if self._sync is not None:
            self._sync()

    def stamp(self) -> float:
        return time.perf_counter()

    def resolve(self, stamps: Sequence[float]) -> list[float]:
        if self._sync is not None:
            self._sync()  # the iteration's end: the device has finished what was queued
        if not stamps:
            return []
        t0 = stamps[0]
        return [(s - t0) * 1e3 for s in stamps]


class EventClock(Clock):
    """The device's timing events, recorded on the current stream, read once per iteration."""

    kind = "device-events"
    note = "device timing events on the current stream, read at the iteration's end"

    def __init__(self, make_event: Any) -> None:
        self._make = make_event
        self._pool: list[Any] = []
        self._used = 0

    def start(self) -> None:
        self._used = 0

    def stamp(self) -> Any:
        if self._used == len(self._pool):
            self._pool.append(self._make())
        ev = self._pool[self._used]
        self._used += 1
        ev.record()
        return ev

    def resolve(self, stamps: Sequence[Any]) -> list[float]:
        if not stamps:
            return []
        stamps[-1].synchronize()  # the one wait of the iteration; the others are done by then
        first = stamps[0]
        return [0.0 if s is first else float(first.elapsed_time(s)) for s in stamps]


def make_clock() -> Clock:
    """The clock of the active adapter: host where the device is the host, its events where it makes them, else
    the host clock synchronized at iteration boundaries (and said so)."""
    from portspeed import get_accelerator

    acc = get_accelerator()
    if getattr(acc, "device_is_host", False):
        return HostClock()
    try:
        probe = acc.Event(enable_timing=True)
        other = acc.Event(enable_timing=True)
        probe.record()
        other.record()
        other.synchronize()
        float(probe.elapsed_time(other))
    except Exception as exc:  # an adapter without timing events: say so in the recording
        why = f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        return HostClock("host-synchronized", f"the device has no timing events ({why}); host time, the device "
                         "synchronized at iteration boundaries only: per-module times are when work was queued",
                         sync=acc.synchronize)
    return EventClock(lambda: acc.Event(enable_timing=True))
