"""One timed iteration as one JSON line of ``DIR/rank<R>.jsonl`` (read by ``portspeed.perf.reading.recordings``).

Why one line per iteration and rank: a rank appends without coordinating with the others, a job that
dies keeps the iterations it finished, and ``portspeed compare --perf`` reads any subset. The line
(format ``portspeed-perf`` version 1)::

    {"format": "portspeed-perf", "version": 1, "iteration": 3, "rank": 0, "world": 2, "framework": ...,
     "device": "testdev" (the adapter's name; added by the session, absent from older recordings),
     "clock": "host" | "device-events" | "host-synchronized", "clock_note": "...", "level": "module",
     "syncs_seen_by": "tensor-methods" | "dispatch" | "off",
     "layout": {"tp": 2, "pp": 1, "cp": 1, "ep": 1, "dp": 1, "sp": false, "ranks": {...}},
     "step_ms": 41.2, "forward_backward_ms": 30.1, "wall_start": 1764412345.1,
     "parts": [{"path": "decoder.layers.1.mlp", "class": "MLP", "phase": "forward", "calls": 2,
                "total_ms": 3.1, "self_ms": 1.2, "syncs": {".item()": 8}, "copies": {"d2h": [1, 4096]},
                "fallbacks": {"addmm": 4}, "collective_ms": 0.0, "ops": {"aten::mm": [4, 0.8]},
                "kernels": {"rms_norm reference": 2}, "peak_bytes": 1048576}, ...],
     "collectives": [{"op": "all_reduce", "group": [0, 1], "seq": 0, "bytes": 4096, "dtype": "float32",
                      "reduce_op": "SUM", "module": "...", "phase": "forward", "enter": ..., "leave": ...,
                      "device_ms": 0.41, "rewrites": {}}, ...]}

The session adds the link's key: ``"adapter"``, ``"backend"`` (the default group's real backend) and
``"host"``, which ``portspeed compare --perf`` looks up in the link bandwidth table (``perf.reading.links``).
``spans`` lists every call as ``[path, phase, start_ms, end_ms]`` from the iteration's start (for a Chrome
trace: ``portspeed compare --perf RUN --chrome FILE``). ``parts`` has one row per (module path, phase), summed over
micro-batches and calls, plus two rows for the time outside every module: ``(outside-modules)`` (phase
``forward-backward``: the schedule, the loss function, pipeline transfers) and ``(optimizer)`` (phase ``step``: from the
schedule's return to the iteration's end).
"""

from __future__ import annotations

import json
import os
from typing import Any, Sequence

from portspeed.perf.clock import Clock
from portspeed.perf.spans import Span

__all__ = ["FORMAT", "VERSION", "OUTSIDE", "OPTIMIZER", "append", "exists", "iteration_record", "rank_file"]

FORMAT = "portspeed-perf"
VERSION = 1
OUTSIDE = "(outside-modules)"
OPTIMIZER = "(optimizer)"


def rank_file(folder: str, rank: int) -> str:
    return os.path.join(folder, f"rank{rank}.jsonl")


def exists(path: str) -> bool:
    return os.path.exists(path)


def append(folder: str, rank: int, record: dict[str, Any]) -> None:
    os.makedirs(folder, exist_ok=True)
    with open(rank_file(folder, rank), "a") as f:
        f.write(json.dumps(record, sort_keys=False) + "\n")


def _merge(into: dict[str, Any], counts: dict[str, int]) -> None:
    for k, v in counts.items():
        into[k] = into.get(k, 0) + v


def iteration_record(*, iteration: int, rank: int, world: int, framework: str, clock: Clock, begin: Any,
                     fb_done: Any, end: Any, spans: Sequence[Span], calls: list[dict[str, Any]], level: str,
                     wall0: float, layout: dict[str, Any], syncs_seen_by: str = "dispatch") -> dict[str, Any]:
    """The line of one iteration: every stamp resolved in one read of the clock, spans summed per part."""
    stamps: list[Any] = [begin, fb_done, end]
    index: dict[int, int] = {}

    def slot(stamp: Any) -> int:
        key = id(stamp) if not isinstance(stamp, float) else len(stamps)
        if isinstance(stamp, float) or key not in index:
            index[key] = len(stamps)
            stamps.append(stamp)
        return index[key]

    where = [(slot(s.start), slot(s.end if s.end is not None else fb_done)) for s in spans]
    op_where = [[(name, slot(a), slot(b)) for name, a, b in s.ops] for s in spans]
    timed = [(call, slot(call["_stamps"][0]), slot(call["_stamps"][1])) for call in calls
             if len(call.get("_stamps", ())) == 2]
    ms = clock.resolve(stamps)
    for call in calls:
        call.pop("_stamps", None)
    for call, a, b in timed:
        call["device_ms"] = round(max(0.0, ms[b] - ms[a]), 4)
    dur = [max(0.0, ms[b] - ms[a]) for a, b in where]
    own = {id(s): i for i, s in enumerate(spans)}
    parts: dict[tuple[str, str], dict[str, Any]] = {}
    top_ms = 0.0
    for i, s in enumerate(spans):
        row = parts.setdefault((s.path, s.phase), {"path": s.path, "class": s.cls, "phase": s.phase, "calls": 0,
                                                   "total_ms": 0.0, "self_ms": 0.0, "syncs": {}, "copies": {},
                                                   "fallbacks": {}, "collective_ms": 0.0, "collectives": 0})
        children = sum(dur[own[id(c)]] for c in s.children)
        row["calls"] += 1
        if s.peak >= 0:
            row["peak_bytes"] = max(row.get("peak_bytes", 0), s.peak)
        row["total_ms"] += dur[i]
        row["self_ms"] += max(0.0, dur[i] - children)
        _merge(row["syncs"], s.counts.get("syncs", {}))
        _merge(row["fallbacks"], s.counts.get("fallbacks", {}))
        if s.counts.get("kernels"):
            _merge(row.setdefault("kernels", {}), s.counts["kernels"])
        for kind, (n, nbytes) in s.copies.items():
            got = row["copies"].setdefault(kind, [0, 0])
            got[0] += n
            got[1] += nbytes
        for c in s.collectives:
            call = calls[c]
            row["collectives"] += 1
            if "device_ms" in call:  # the clock the span's own time is on
                row["collective_ms"] += call["device_ms"]
            elif "leave" in call:
                row["collective_ms"] += (call["leave"] - call["enter"]) * 1e3
        if op_where[i]:
            ops = row.setdefault("ops", {})
            for name, a, b in op_where[i]:
                got = ops.setdefault(name, [0, 0.0])
                got[0] += 1
                got[1] += max(0.0, ms[b] - ms[a])
        if s.parent is None:
            top_ms += dur[i]
    step_ms, fb_ms = ms[2] - ms[0], ms[1] - ms[0]
    rows = list(parts.values())
    timeline = [[s.path, s.phase, round(ms[a], 4), round(ms[b], 4)] for s, (a, b) in zip(spans, where)]
    for path, phase, took in ((OUTSIDE, "forward-backward", max(0.0, fb_ms - top_ms)),
                              (OPTIMIZER, "step", max(0.0, ms[2] - ms[1]))):
        rows.append({"path": path, "class": "", "phase": phase, "calls": 1, "total_ms": took, "self_ms": took,
                     "syncs": {}, "copies": {}, "fallbacks": {}, "collective_ms": 0.0, "collectives": 0})
    for row in rows:
        row["total_ms"] = round(row["total_ms"], 4)
        row["self_ms"] = round(row["self_ms"], 4)
        row["collective_ms"] = round(row["collective_ms"], 4)
    return {"format": FORMAT, "version": VERSION, "iteration": iteration, "rank": rank, "world": world,
            "framework": framework, **clock.describe(), "level": level, "syncs_seen_by": syncs_seen_by,
            "layout": layout,
            "step_ms": round(step_ms, 4), "forward_backward_ms": round(fb_ms, 4), "wall_start": wall0,
            "parts": rows, "collectives": calls, "spans": timeline}
