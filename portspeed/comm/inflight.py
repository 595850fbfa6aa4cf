"""The asynchronous collectives still in flight on host-thread backends, waited for at exit while Python is whole.

Why: a backend whose groups run on host threads (Gloo, and the CCLs that stage through it) releases a
finished collective's work on its own thread. If that happens once the interpreter has begun to finalize,
dropping the work's last tensor needs the GIL, CPython ends the thread, and libstdc++ aborts the process:
a job that finished its work dies of SIGABRT (docs/reliability.md, "The abort at exit"). Destroying the
groups at exit (``portspeed.teardown``) stops their threads only for groups nothing else holds; a group the
framework keeps (DeepSpeed keeps its own) keeps them, and a collective issued with ``async_op=True`` and
dropped, or waited a moment before the exit, is still released on that thread: 8 of 30 two-rank jobs aborted
so (``tests/helpers/exit_stress.py --cases held-two``, Python 3.12, torch 2.15, 2026-11-29).

What: the router hands each work it returns for such a group to ``note``, which keeps a reference until the
work is seen completed (checked at the next ``note``: one ``is_completed()`` per work still held, a few at a
time), so that the last reference to a finished work is dropped on a Python thread, never on the backend's.
At exit, ``drain`` waits for those still in flight and keeps them: the interpreter frees them on its own
thread. The teardown's bound (``BOUND_S``, then the stacks and exit 1) covers a collective whose peers never
join. Groups on other backends (NCCL) are not touched.
"""

from __future__ import annotations

from typing import Any

from portspeed import teardown

__all__ = ["note", "drain", "held"]

_held: list[Any] = []


def _done(work: Any) -> bool:
    try:
        return bool(work.is_completed())
    except Exception:  # noqa: BLE001 - not a work that can say (a placeholder inside a coalescing batch): let go
        return True


def note(work: Any) -> Any:
    """Keep ``work`` (a collective's ``Work``, or None) until it is seen completed; returns it. Only objects
    whose ``is_completed`` can be called are kept (inside a coalescing batch torch hands back placeholders)."""
    if work is not None and callable(getattr(work, "is_completed", None)):
        if _held:
            _held[:] = [w for w in _held if not _done(w)]
        _held.append(work)
    return work


def held() -> int:
    """How many works are held now (for tests)."""
    return len(_held)


def drain() -> None:
    """At exit: wait for every work still held, and keep them (the interpreter frees them on its own thread)."""
    for work in list(_held):
        try:
            if not _done(work):
                work.wait()
        except Exception:  # noqa: BLE001 - its group gone or failed: nothing left in flight to wait for
            continue


teardown.before_destroy(drain)
