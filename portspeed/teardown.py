"""The process groups a script leaves behind, destroyed at interpreter exit while Python is still whole.

Why: a script that ends without ``destroy_process_group`` (stock ``pretrain_gpt.py``, most training
scripts) leaves its groups' backend threads running into the interpreter's finalization. When one of
Gloo's workers (``ProcessGroupGloo::runLoop``; the test device's CCL stages through Gloo too) finishes
a collective then, destroying the finished work drops the last reference to a tensor whose Python
object the tensor keeps alive; that decref needs the GIL, CPython ends any thread that asks for the
GIL once finalization has begun (``pthread_exit``), the forced unwind meets the worker's ``noexcept``
frame, and libstdc++ calls ``std::terminate``: "terminate called without an active exception",
SIGABRT, after the job printed its result. Rare per process (the work must finish in that window),
common over the hundreds of processes of a CI run (docs/reliability.md, "The abort at exit").

What: ``install()`` registers one ``atexit`` handler (``portspeed`` does at import, so it runs after
every handler registered later: the flight recorder's and the probe's exit dumps come first). At exit
it destroys every group still registered (Megatron's ``destroy_model_parallel`` first, so that its module
globals let go of theirs), so the backends' threads finish and release their tensors while the interpreter
can still take them. It does so on the exiting thread: Python 3.12 refuses to start threads once the
interpreter is shutting down ("can't create new thread at interpreter shutdown"), atexit handlers included.
The wait is bounded by ``faulthandler.dump_traceback_later`` (its watchdog is C's, not a Python thread):
after ``BOUND_S`` seconds it prints every thread's stack, this handler's frame on top, and exits 1.

torch's ``destroy_process_group`` stops a Gloo group's threads only when the last Python reference to the
group goes; a group some other object still holds (DeepSpeed's own) keeps them into finalization, so what
runs first (``before_destroy``: ``portspeed.comm.inflight.drain``) waits for the asynchronous collectives still
in flight and keeps them, and the router keeps each such work until it is seen completed: no finished work is
released on a backend thread once finalization has begun.
Not when the process is ending on an uncaught exception (``sys.last_value``): a failing rank's
groups may hold a collective its peers never join, and it must not wait for them. A group still busy
after the bound (a collective whose peers never joined) ends the process with exit status 1 and the
stacks on stderr: the job did not finish cleanly, and the launcher is told so.
"""

from __future__ import annotations

import atexit
import sys
import threading
from typing import Callable

__all__ = ["BOUND_S", "before_destroy", "destroy_leftover_groups", "install"]

#: seconds the exit handler waits for the groups to be destroyed (milliseconds when nothing is in flight)
BOUND_S = 30.0
_installed = False
_lock = threading.Lock()
#: what runs at exit before the groups are destroyed, under the same bound (``portspeed.comm.inflight.drain``)
_before: list[Callable[[], None]] = []


def before_destroy(fn: Callable[[], None]) -> None:
    """Run ``fn()`` at exit before the leftover groups are destroyed, inside the handler's bound (a layer above
    registers it: the foundation imports nothing of portspeed)."""
    if fn not in _before:
        _before.append(fn)


def install() -> None:
    """Register the exit handler once per process (idempotent, cheap: imports nothing)."""
    global _installed
    with _lock:
        if not _installed:
            atexit.register(destroy_leftover_groups)
            _installed = True


def destroy_leftover_groups(bound_s: float = BOUND_S) -> bool:
    """Destroy the process groups still registered; True when there were some and they are gone."""
    c10d = sys.modules.get("torch.distributed.distributed_c10d")
    if c10d is None or getattr(sys, "last_value", None) is not None:
        return False
    try:
        if not c10d.is_initialized():
            return False
    except Exception:  # noqa: BLE001 - a torch without the distributed package built
        return False
    import faulthandler

    faulthandler.dump_traceback_later(bound_s, exit=True)  # still busy then: the stacks on stderr, exit 1
    try:
        for fn in _before:
            fn()
        _forget_megatron_groups()
        c10d.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported, never raised at exit
        print(f"portspeed: destroying the process groups at exit failed: {exc!r}", file=sys.stderr, flush=True)
        return False
    finally:
        faulthandler.cancel_dump_traceback_later()
    return True


def _forget_megatron_groups() -> None:
    """Megatron's ``parallel_state`` holds its groups in module globals: a destroyed group that Python still
    references keeps its backend threads until finalization frees it, so Megatron lets go of them first."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None and getattr(state, "model_parallel_is_initialized", lambda: False)():
        state.destroy_model_parallel()
