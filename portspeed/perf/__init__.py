"""Where a port is slow: zero-edit timing of chosen iterations, per rank, module by module.

``portspeed run --perf DIR`` (or ``PORTSPEED_PERF`` under torchrun) times, with no edit to the
training script, each module's forward and backward (its own time and with its children), the host
syncs (``.item()``, device-to-host copies, data-dependent shapes), host<->device copies and CPU-fallback
ops inside each module, and each collective's group, op, bytes, dtype and enter / leave times. The
device's own timing events are used where it has them (``portspeed.perf.clock``); nothing synchronizes
the device per module. Megatron's schedule and optimizer mark iterations through patches declared
only when ``PORTSPEED_PERF`` is set (``patches/perf.py``); an own loop marks them with one call::

    import portspeed.perf
    for n in range(1, steps + 1):
        with portspeed.perf.iteration(n, model):     # does nothing when PORTSPEED_PERF is not set
            loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()

Each rank appends one JSON line per timed iteration to ``DIR/rank<R>.jsonl`` (``portspeed.perf.writer``);
``portspeed compare --perf REF RUN`` names the part whose share of the step grew most, and
``portspeed compare --perf RUN`` the slow rank (docs/performance.md).
"""

from __future__ import annotations

from typing import Any, ContextManager

from portspeed.probe.sessions import LoopMarks

__all__ = ["iteration", "begin_iteration", "end_iteration", "forward_backward_done", "active"]

_MARKS = LoopMarks("portspeed.perf.session", is_active=lambda s: s.open)


def begin_iteration(n: int, model: Any) -> None:
    """Iteration ``n`` (1-based) of ``model`` (a module, or a list of model chunks) begins."""
    _MARKS.begin(n, model)


def forward_backward_done() -> None:
    """Optional: the forward and backward are over (what follows is timed as the optimizer step)."""
    _MARKS.call("forward_backward_done")


def end_iteration() -> None:
    """The iteration begun by ``begin_iteration`` is over: its line is written."""
    _MARKS.call("end")


def iteration(n: int, model: Any) -> ContextManager[None]:
    """``begin_iteration(n, model)`` ... ``end_iteration()`` around the block (also when it raises)."""
    return _MARKS.around(n, model)


def active() -> bool:
    """Whether an iteration is being timed in this process now."""
    return _MARKS.active()
