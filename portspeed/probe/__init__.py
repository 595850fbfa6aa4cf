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

Floors (``tests/test_layers.py``; docs/architecture.md), each importing only those below it:

- recording (this package's modules; the plugins floor): ``session`` an iteration's life, ``sessions`` one
  session per process (shared with ``portspeed.perf``), ``stats``, ``entries``, ``modules``, ``params``, ``ops``,
  ``collectives``, ``kernel_calls``, ``nan``, ``meta``, ``writer``; ``sharding`` how a module's tensors are split
  over tp / cp / ep / dp as the run records it; ``replay`` a recorded op run again (for precheck).
- reading (``reading``; the parity floor: the foundation only, no torch): ``reading.dumps`` the dumps read,
  ``reading.pairing`` a run's entries paired with the reference's across layouts, ``reading.bands``,
  ``reading.compare`` (`portspeed compare --probe`).
- command line (``cli``): ``cli.options`` (`portspeed run --probe DIR`'s switches), ``cli.recording_options``
  (what they share with ``--perf``'s), ``cli.precheck`` (`portspeed precheck DIR`).

This file imports nothing at its import (the marks' session module is loaded at the first mark), so reading a
probe folder (``portspeed compare --probe``) loads no recording code and no torch.
"""

from __future__ import annotations

from typing import Any, ContextManager

__all__ = ["iteration", "begin_iteration", "end_iteration", "active"]

_MARKS = None  # portspeed.probe.sessions.LoopMarks, made at the first mark: importing this package loads nothing


def _marks() -> Any:
    global _MARKS
    if _MARKS is None:
        from portspeed.probe.sessions import LoopMarks
        _MARKS = LoopMarks("portspeed.probe.session", is_active=lambda s: s.record is not None,
                           begun=lambda s: s.watch_torch_optimizers())
    return _MARKS


def begin_iteration(n: int, model: Any) -> None:
    """Iteration ``n`` (1-based, as the loop counts) of ``model`` (a module, or a list of model chunks) begins."""
    _marks().begin(n, model)


def end_iteration() -> None:
    """The iteration begun by ``begin_iteration`` is over: its dump is written (and --probe-nan checks it)."""
    _marks().call("end")


def iteration(n: int, model: Any) -> ContextManager[None]:
    """``begin_iteration(n, model)`` ... ``end_iteration()`` around the block (also when it raises)."""
    return _marks().around(n, model)


def active() -> bool:
    """Whether an iteration is being recorded (or watched by --probe-nan) in this process now."""
    return _marks().active()
