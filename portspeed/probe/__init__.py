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

import contextlib
from typing import Any, Iterator

__all__ = ["iteration", "begin_iteration", "end_iteration", "active"]


def _chunks(model: Any) -> list:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def begin_iteration(n: int, model: Any) -> None:
    """Iteration ``n`` (1-based, as the loop counts) of ``model`` (a module, or a list of model chunks) begins."""
    from portspeed.probe import session

    s = session.current()
    if s is not None:
        s.begin(int(n), _chunks(model), framework="loop", explicit=True)
        s.watch_torch_optimizers()


def end_iteration() -> None:
    """The iteration begun by ``begin_iteration`` is over: its dump is written (and --probe-nan checks it)."""
    from portspeed.probe import session

    s = session.current()
    if s is not None:
        s.end()


@contextlib.contextmanager
def iteration(n: int, model: Any) -> Iterator[None]:
    """``begin_iteration(n, model)`` ... ``end_iteration()`` around the block (also when it raises)."""
    begin_iteration(n, model)
    try:
        yield
    finally:
        end_iteration()


def active() -> bool:
    """Whether an iteration is being recorded (or watched by --probe-nan) in this process now."""
    from portspeed.probe import session

    s = session.current()
    return s is not None and s.record is not None


