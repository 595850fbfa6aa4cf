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
globals let go of theirs), in a helper thread joined for at most ``BOUND_S`` seconds, so the backends'
threads finish and release their tensors while the interpreter can still take them.

Limits: torch's ``destroy_process_group`` stops a Gloo group's threads only when the last Python reference
to the group goes; a group some other object still holds (a model wrapper's attribute) keeps them into
finalization, where a collective still in flight there (one issued asynchronously and never waited) can
still abort as before.
Not when the process is ending on an uncaught exception (``sys.last_value``): a failing rank's
groups may hold a collective its peers never join, and it must not wait for them. A group that is
still busy after the bound is left as it was, with one line on stderr.
"""

from __future__ import annotations

import atexit
import sys
import threading

__all__ = ["BOUND_S", "destroy_leftover_groups", "install"]

#: seconds the exit handler waits for the groups to be destroyed (milliseconds when nothing is in flight)
BOUND_S = 30.0
_installed = False
_lock = threading.Lock()


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
    failure: list[BaseException] = []

    def destroy() -> None:
        try:
            _forget_megatron_groups()
            c10d.destroy_process_group()
        except BaseException as exc:  # noqa: BLE001 - reported below, never raised at exit
            failure.append(exc)

    worker = threading.Thread(target=destroy, name="portspeed-exit-teardown", daemon=True)
    worker.start()
    worker.join(bound_s)
    if worker.is_alive():
        print(f"portspeed: the process groups were still busy {bound_s:.0f} s into the exit (a collective whose "
              "peers never joined); leaving without destroying them", file=sys.stderr, flush=True)
        return False
    if failure:
        print(f"portspeed: destroying the process groups at exit failed: {failure[0]!r}", file=sys.stderr, flush=True)
        return False
    return True


def _forget_megatron_groups() -> None:
    """Megatron's ``parallel_state`` holds its groups in module globals: a destroyed group that Python still
    references keeps its backend threads until finalization frees it, so Megatron lets go of them first."""
    state = sys.modules.get("megatron.core.parallel_state")
    if state is not None and getattr(state, "model_parallel_is_initialized", lambda: False)():
        state.destroy_model_parallel()
