"""Each collective of a timed iteration: group, op, bytes, dtype, when this rank entered and left, what the router did.

Why enter and leave on the wall clock: a collective's time on one rank is mostly waiting for the last
rank to arrive, then moving bytes; only the spread of the ranks' enter times tells the two apart, and
that needs one clock for every rank (``time.time()``: the same clock for the ranks of one host; across
hosts, as good as their clock synchronization). The calls reach this recorder through the probe's
wrappers (``portspeed.probe.collectives.recorded``), plugged into a slot of their own (``SLOT``), so the
probe and the perf recording can both run; ``patches/perf.py`` declares them only when
``PORTSPEED_PERF`` is set. The router's rewrites are seen as the change of ``portspeed.comm.stats()``
across the call (the wrapper sits outside the router, so it sees the caller's op: AVG, bf16, ...).

Per call (``calls``): ``op``, ``group`` (its global ranks), ``seq`` (this rank's n-th call of that op
on that group: the key that matches a call across ranks), ``bytes`` (the largest buffer, as
nccl-tests counts), ``dtype``, ``reduce_op``, ``enter`` / ``leave`` (seconds, wall clock; an
``async_op=True`` call leaves at ``wait()``), ``module`` and ``phase`` (the span it ran in),
``rewrites`` ({rewrite: count}, empty when the backend ran it as asked), and ``device_ms``: the call on
the recording's clock, one stamp before it and one after it returned (or after its ``wait()``), resolved
with the iteration's other stamps. On a device with timing events those are events on the current
stream, and the one after the call comes after the stream was made to wait for the collective: the time
the device spent in it, not when the host saw it end, and the same clock as the modules' times it is
taken from.
"""

from __future__ import annotations

import inspect
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from portspeed.probe.collectives import RECORDED, Slot, _coalescing

__all__ = ["SLOT", "CollectiveTimer", "RECORDED"]

#: the perf recording's slot in the collective wrappers
SLOT = Slot()

_SIGNATURES: dict[str, inspect.Signature | None] = {}


def _bound(name: str, args: tuple, kwargs: dict) -> dict[str, Any]:
    sig = _SIGNATURES.get(name)
    if name not in _SIGNATURES:
        try:
            sig = inspect.signature(getattr(dist, name))
        except (AttributeError, TypeError, ValueError):
            sig = None
        _SIGNATURES[name] = sig
    if sig is None:
        return dict(kwargs)
    try:
        return dict(sig.bind_partial(*args, **kwargs).arguments)
    except TypeError:
        return dict(kwargs)


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    if type(value).__name__ == "P2POp":
        return [value.tensor]
    return []


def _nbytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


class CollectiveTimer:
    """One iteration's collectives (the target ``SLOT`` takes); ``charge()`` is the span a call runs in."""

    def __init__(self, charge: Callable[[], Any], stamp: Callable[[], Any] | None = None) -> None:
        self.charge, self.stamp = charge, stamp
        self.calls: list[dict[str, Any]] = []
        self._seq: dict[tuple, int] = {}
        self._ranks: dict[int, list[int]] = {}

    def _group_ranks(self, group: Any) -> list[int]:
        key = id(group)
        got = self._ranks.get(key)
        if got is None:
            try:
                got = list(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
            except Exception:  # a group this rank is not in, or torn down
                got = []
            self._ranks[key] = got
        return got

    def collective(self, name: str, args: tuple, kwargs: dict) -> Callable[[], None] | None:
        """Note the call's enter time; the function that notes its leave time (at once, or at ``wait()``)."""
        from portspeed import comm

        bound = _bound(name, args, kwargs)
        group = bound.get("group")
        ranks = self._group_ranks(group)
        key = (tuple(ranks), name)
        seq = self._seq.get(key, 0)
        self._seq[key] = seq + 1
        tensors = [t for v in bound.values() for t in _tensors(v)]
        sizes = [_nbytes(v) for v in bound.values()]
        span = self.charge()
        reduce_op = bound.get("op")
        call: dict[str, Any] = {
            "op": name, "group": ranks, "seq": seq, "bytes": max(sizes) if sizes else 0,
            "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else None,
            "reduce_op": None if reduce_op is None or callable(reduce_op) else str(reduce_op).split(".")[-1],
            "module": span.path if span is not None else None,
            "phase": "backward" if torch._C._current_graph_task_id() != -1 else "forward",
        }
        if span is not None:
            span.collectives.append(len(self.calls))
        self.calls.append(call)
        before = comm.stats()
        if self.stamp is not None:  # the recording's clock (device events where the device has them)
            call["_stamps"] = [self.stamp()]
        call["enter"] = time.time()
        if _coalescing():  # issued when the batch closes, which this call cannot see
            call["coalesced"] = True
            return None

        def finish() -> None:
            call["leave"] = time.time()
            stamps = call.get("_stamps")  # gone when the iteration's line was written before this wait()
            if stamps is not None:  # after the call (or its wait()): the device has the collective done
                stamps.append(self.stamp())
            after = comm.stats()
            call["rewrites"] = {how: n - before.get(c, {}).get("by", {}).get(how, 0)
                                for c, entry in after.items() for how, n in entry.get("by", {}).items()
                                if n != before.get(c, {}).get("by", {}).get(how, 0)}

        return finish
