"""Which implementation of the portable Transformer Engine's kernels ran inside each module of a timed iteration.

Why: a port that serves Megatron's TE modules through portspeed's portable TE may run a kernel's
``reference`` implementation (written-out arithmetic) where the reference run had the vendor's or torch's
fused one (``portspeed.portable_te.kernels``: the ladder vendor -> torch -> reference, or
``PORTSPEED_TE_KERNELS``); that is a cause ``compare --perf`` names. The kernel registry has one dispatch
point with an observer slot (the probe's op level uses it: ``portspeed.probe.kernel_calls``); ``watch``
chains onto it for the timed iteration, counting each call as ``"<op> <impl>"`` in the innermost span's
``kernels``, and puts the previous observer back when the schedule returns. A process that never imported
the portable TE is left alone (nothing is imported here).
"""

from __future__ import annotations

import sys
from typing import Any, Callable

__all__ = ["watch"]


def watch(charge: Callable[[], Any]) -> Callable[[], None]:
    """Count kernel calls into ``charge()``'s span from now on; returns the function that stops it."""
    kernels = sys.modules.get("portspeed.portable_te.kernels")
    if kernels is None:
        return lambda: None
    previous = kernels.observer

    def observer(op: str, impl: str, fn: Callable) -> Callable:
        inner = previous(op, impl, fn) if previous is not None else fn
        name = f"{op} {impl}"

        def call(*args: Any, **kwargs: Any) -> Any:
            span = charge()
            if span is not None:
                span.count("kernels", name)
            return inner(*args, **kwargs)

        call.__ps_served__ = getattr(inner, "__ps_served__", fn)  # type: ignore[attr-defined]
        call.__name__ = getattr(fn, "__name__", op)
        return call

    kernels.observer = observer

    def stop() -> None:
        kernels.observer = previous

    return stop
