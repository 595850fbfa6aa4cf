"""Running a rewritten collective: its work handle, its last step, and coalescing batches.

Why: a rewrite is a few collectives the backend does right plus a last step in Python
(divide, copy back, slice). With ``async_op=True`` the caller gets a handle before the
inner collectives finish, so the last step must run when the caller waits
(``RewriteWork``); without it, at once (``complete``). Inside torch's
``_coalescing_manager`` calls are recorded and issued at its exit, which a rewrite's last
step cannot join, so ``run`` issues the rewrite at once, outside the batch.

Contract
- ``RewriteWork(works, finish, result)``: a ``dist.Work``; ``wait()`` waits for the inner
  works, runs ``finish`` once, and returns True; ``is_completed()`` is True after that.
- ``ThenWork(inner, then)``: a backend's own work with one step of portspeed's run at its first
  ``wait()`` (or ``result()``); everything else asks the backend's work (the probe records, the NaN
  check checks an output there).
- ``complete(works, finish, async_op)``: a ``RewriteWork`` when ``async_op``, else waits,
  finishes and returns None (what torch's collectives return synchronously).
- ``run(group, async_op, body, in_batch=False)``: calls ``body(inner_async)``; returns None on
  ranks outside ``group`` (as torch does); inside a coalescing batch runs ``body(False)``
  outside it, unless ``in_batch`` (a rewrite that is one collective on the caller's
  storage with no last step, so the batch may record it as it would the original).

Limits: in a coalescing batch a rewritten collective runs synchronously (correct values,
less overlap); the all_gather view (``in_batch``) is the exception and stays in the batch.

Old torch: torch 2.6.0's ``_coalescing_manager`` ends a batch in which nothing was recorded
with ``UnboundLocalError`` (its ``work`` is never set; 2.8.0's sets it to None first), which
is what a batch whose every call was rewritten leaves; ``wrap_coalescing_manager`` (a patch
below torch 2.8 only) ends such a batch as later releases do: nothing to issue or wait for.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portspeed.comm.backends import _pg

__all__ = ["RewriteWork", "ThenWork", "complete", "run", "wrap_coalescing_manager"]


class RewriteWork(dist.Work):
    """The work handle of a rewritten collective: wait() waits for the inner ones, then finishes."""

    def __init__(self, works: list, finish: Callable[[], None], result: Any = None) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._result = result
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for w in self._works:
                w.wait()
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        """A completed future (waits first: the rewrite's last step runs in Python)."""
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def result(self) -> Any:
        self.wait()
        return self._result


class ThenWork(dist.Work):
    """A backend's work handle with one step after it: ``then`` runs once, at the first ``wait()`` or ``result()``."""

    def __init__(self, inner: Any, then: Callable[[], None]) -> None:
        super().__init__()
        self._inner = inner
        self._then: Callable[[], None] | None = then

    def wait(self, timeout: Any = None) -> bool:
        done = self._inner.wait() if timeout is None else self._inner.wait(timeout)
        then, self._then = self._then, None
        if then is not None:
            then()
        return done if isinstance(done, bool) else True

    def is_completed(self) -> bool:
        return self._inner.is_completed()

    def is_success(self) -> bool:
        return self._inner.is_success()

    def exception(self) -> Any:
        return self._inner.exception()

    def source_rank(self) -> int:
        return self._inner.source_rank()

    def result(self) -> Any:
        self.wait()
        return self._inner.result()

    def get_future(self) -> torch.futures.Future:
        """The backend's own future (the step is not run through it)."""
        return self._inner.get_future()


def nothing() -> None:
    """A last step that does nothing (the inner collective already wrote the caller's tensor)."""
    return None


def complete(works: list, finish: Callable[[], None], async_op: bool, result: Any = None) -> Any:
    """Hand back ``RewriteWork`` (async) or wait for ``works`` and run ``finish`` now (returns None)."""
    if async_op:
        return RewriteWork(works, finish, result)
    for w in works:
        if w is not None:
            w.wait()
    finish()
    return None


def _in_coalescing(group: Any) -> bool:
    state = getattr(c10d._world, "pg_coalesce_state", None)
    return bool(state) and _pg(group) in state


def run(group: Any, async_op: bool, body: Callable[[bool], Any], in_batch: bool = False) -> Any:
    """Run ``body(inner_async)`` for a rank of ``group``, outside any coalescing batch unless ``in_batch``."""
    if group is not None and c10d._rank_not_in_group(group):
        return None
    if not in_batch and _in_coalescing(group):
        # the coalescing manager records calls and runs them at its exit; a rewrite has
        # steps after its inner calls, so run it now, outside the recorded batch
        pg = _pg(group)
        ops = c10d._world.pg_coalesce_state.pop(pg)
        try:
            body(False)
        finally:
            c10d._world.pg_coalesce_state[pg] = ops
        return RewriteWork([], nothing) if async_op else None
    return body(async_op)


class _EmptyBatchSafe:
    """An old torch's coalescing manager whose exit with nothing recorded is a no-op, as from torch 2.8."""

    def __init__(self, inner: Any, group: Any, device: Any) -> None:
        self._inner, self._group, self._device = inner, group, device

    def __enter__(self) -> Any:
        return self._inner.__enter__()

    def __exit__(self, et: Any, ev: Any, tb: Any) -> Any:
        if et is None and not self._device:
            pg = self._group or c10d._get_default_group()
            state = c10d._world.pg_coalesce_state
            if not state.get(pg):  # every call ran outside the batch (rewritten): nothing to issue
                state.pop(pg, None)
                self._abandon()  # the rest of torch's exit would read an unset ``work``
                return False
        return self._inner.__exit__(et, ev, tb)

    def _abandon(self) -> None:
        """Close torch's generator without running its exit (through any wrapper of the same kind)."""
        inner = self._inner
        if isinstance(inner, _EmptyBatchSafe):
            inner._abandon()
        elif getattr(inner, "gen", None) is not None:
            inner.gen.close()


def wrap_coalescing_manager(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torch < 2.8's ``_coalescing_manager``, made to end a batch with nothing recorded (see the docstring)."""
    group = args[0] if args else kwargs.get("group")
    device = args[1] if len(args) > 1 else kwargs.get("device")
    return _EmptyBatchSafe(wrapped(*args, **kwargs), group, device)
