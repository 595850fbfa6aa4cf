"""Zero-edit probing: module- and op-level statistics of chosen iterations, in msprobe's dump layout.

``portspeed run --probe DIR`` (or ``PORTSPEED_PROBE_DIR`` under torchrun) records, with no edit to
the training script, every module's outputs and their gradients, every parameter's gradient
before the optimizer step and its value after, and at ``--probe-level op`` every torch function
and collective inside the modules; ``--probe-nan`` names the first module whose output turned
non-finite and stops the job. Megatron's schedule and optimizer, DeepSpeed's engine and the HF
Trainer mark iterations through patches declared only when probing is configured
(``patches/probe.py``, ``patches/megatron/probe.py``); an own loop marks them with one call::

    import portspeed.probe
    for n in range(1, steps + 1):
        with portspeed.probe.iteration(n, model):     # does nothing when probing is not configured
            loss = model(x).sum(); loss.backward(); optimizer.step(); optimizer.zero_grad()

The format is docs/probe-format.md; ``portspeed compare --probe REF RUN`` reads it.
"""

from __future__ import annotations

from typing import Any, ContextManager

from portspeed.probe.sessions import LoopMarks

__all__ = ["iteration", "begin_iteration", "end_iteration", "active"]

_MARKS = LoopMarks("portspeed.probe.session", is_active=lambda s: s.record is not None,
                   begun=lambda s: s.watch_torch_optimizers())


def begin_iteration(n: int, model: Any) -> None:
    """Iteration ``n`` (1-based, as the loop counts) of ``model`` (a module, or a list of model chunks) begins."""
    _MARKS.begin(n, model)


def end_iteration() -> None:
    """The iteration begun by ``begin_iteration`` is over: its dump is written (and --probe-nan checks it)."""
    _MARKS.call("end")


def iteration(n: int, model: Any) -> ContextManager[None]:
    """``begin_iteration(n, model)`` ... ``end_iteration()`` around the block (also when it raises)."""
    return _MARKS.around(n, model)


def active() -> bool:
    """Whether an iteration is being recorded (or watched by --probe-nan) in this process now."""
    return _MARKS.active()
