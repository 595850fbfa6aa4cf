"""A perf recording as a Chrome trace (``portspeed compare --perf RUN --chrome FILE``): Perfetto, chrome://tracing.

Why: the first line names one part; the timeline shows what happened around it, rank beside rank. Each
rank is a process (``rank R``) with two rows: the module spans (nested, forward and backward, one complete
event per call, ``args``: the phase and the iteration) and the collectives (``args``: group, bytes, dtype,
sequence number, the router's rewrites). Times are microseconds on the wall clock: a span is placed at
its iteration's wall-clock start plus its offset on the recording's clock (the device's events, or the
host's), so on a device with events the rows of one rank are exact among themselves and aligned with the
collectives to the precision of that start.
"""

from __future__ import annotations

import json
from typing import Any

from portspeed.perf.reading.recordings import PerfRun

__all__ = ["chrome_trace", "write_chrome"]

_MODULES, _COLLECTIVES = 0, 1


def chrome_trace(run: PerfRun) -> dict[str, Any]:
    """The trace events of every line of ``run``."""
    events: list[dict[str, Any]] = []
    for rank in run.ranks:
        events.append({"ph": "M", "name": "process_name", "pid": rank, "args": {"name": f"rank {rank}"}})
        for tid, name in ((_MODULES, "modules"), (_COLLECTIVES, "collectives")):
            events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
    for (iteration, rank), line in sorted(run.lines.items()):
        t0 = float(line.get("wall_start") or 0.0) * 1e6
        for path, phase, start, end in line.get("spans", []):
            events.append({"ph": "X", "name": path, "cat": phase, "pid": rank, "tid": _MODULES,
                           "ts": t0 + start * 1e3, "dur": max(0.0, (end - start) * 1e3),
                           "args": {"phase": phase, "iteration": iteration}})
        for call in line.get("collectives", []):
            if "leave" not in call:
                continue
            events.append({"ph": "X", "name": call["op"], "cat": "collective", "pid": rank, "tid": _COLLECTIVES,
                           "ts": call["enter"] * 1e6, "dur": max(0.0, (call["leave"] - call["enter"]) * 1e6),
                           "args": {k: call.get(k) for k in ("group", "seq", "bytes", "dtype", "reduce_op", "module",
                                                             "phase", "rewrites")} | {"iteration": iteration}})
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def write_chrome(run: PerfRun, path: str) -> int:
    """Write ``run``'s trace to ``path``; the number of events."""
    trace = chrome_trace(run)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(trace, f)
    return len(trace["traceEvents"])
