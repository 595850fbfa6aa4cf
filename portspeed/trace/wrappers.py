"""The recording frames put in front of ``torch.distributed``'s functions when ``PORTSPEED_TRACE`` is on.

Why a module of its own: the recorder (``portspeed.trace.flight_recorder``) holds the ring buffer, the
sequence numbers and the dumps; these are the thin frames that feed it, installed by
``patches/torch_distributed.py`` in place of (or in front of the router's) function. Each is
one plain-function frame: issue an entry, call the original, mark it done or failed; a call
made inside a recorded one, or while torch.compile traces, is passed straight through.
"""

from __future__ import annotations

from typing import Any, Callable

from portspeed.trace.flight_recorder import recorder

__all__ = ["traced", "traced_batch"]


def traced(name: str, route: Callable[[Callable], Callable] | None = None) -> Callable[[Callable], Callable]:
    """A factory ``make(original) -> recorded`` (``style="function"``): records ``name`` around ``route(original)``
    (the router's function) or ``original`` itself."""
    import torch

    compiling = torch.compiler.is_dynamo_compiling

    def make(original: Callable) -> Callable:
        inner = route(original) if route is not None else original
        rec = recorder()
        if rec is None:
            return inner

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if rec.busy or compiling():
                return inner(*args, **kwargs)
            try:
                e = rec.issue(name, args, kwargs)
            except Exception:  # arguments torch itself will refuse (not tensors...): its error, not ours
                rec.busy = False
                return inner(*args, **kwargs)
            try:
                out = inner(*args, **kwargs)
            except BaseException as error:
                rec.fail(e, error)
                raise
            rec.done(e, out)
            return out

        recorded.__name__ = recorded.__qualname__ = getattr(original, "__name__", name)
        recorded.__doc__ = (f"torch.distributed.{name}, recorded by portspeed.trace.flight_recorder.\n\n"
                            + (original.__doc__ or ""))
        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    make.__name__ = make.__qualname__ = f"trace_{name}"
    return make


def traced_batch(original: Callable) -> Callable:
    """``batch_isend_irecv``: one entry per operation of the batch (send or recv, with its peer)."""
    rec = recorder()
    if rec is None:
        return original

    def recorded(p2p_op_list: list) -> Any:
        if rec.busy:
            return original(p2p_op_list)
        issued = []
        try:
            for p in p2p_op_list:
                kind = "isend" if "send" in getattr(p.op, "__name__", "") else "irecv"
                issued.append(rec.issue(kind, (p.tensor, p.peer, p.group), {}))
        except Exception:  # not P2POps: torch's own check answers the call
            rec.busy = False
            return original(p2p_op_list)
        rec.busy = True
        try:
            works = original(p2p_op_list)
        except BaseException as error:
            rec.fail(issued[-1] if issued else {"ps_op": "batch_isend_irecv"}, error)
            raise
        rec.busy = False
        rec.in_flight = None
        for e, w in zip(issued, works or []):
            rec.done(e, w)
        return works

    recorded.__name__ = recorded.__qualname__ = "batch_isend_irecv"
    recorded.__doc__ = original.__doc__
    recorded.__wrapped__ = original  # type: ignore[attr-defined]
    return recorded
