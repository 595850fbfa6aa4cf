"""Megatron's iterations, seen by the perf recording with no edit to the training script (declared only when
``PORTSPEED_PERF`` is set).

The same boundaries as the probe's (``patches/megatron/probe.py``, which says why): a training call of
the schedule ``get_forward_backward_func()`` returns begins iteration ``n`` on its model chunks and, when
it returns, ends the forward/backward; the outermost Megatron optimizer's ``step()`` ends the iteration
(the time between is the ``(optimizer step)`` part). The iteration's number is the probe's
(``iteration_number``: Megatron-LM's ``args.curr_iteration + 1``, else the count of training calls).
Evaluation's calls (``forward_only=True``) are left alone.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from portspeed.patching.record import WRAP, Patch
from portspeed.perf import session as perf_session

from .probe import iteration_number
from .ranges import CORE, DISTRIBUTION

__all__ = ["perf_patches"]

_OPTIMIZER = "megatron.core.optimizer.optimizer"
_in_step = [False]


def _timed(schedule: Callable) -> Callable:
    @functools.wraps(schedule)
    def timed_schedule(*args: Any, **kwargs: Any) -> Any:
        s = perf_session.current()
        if s is None or kwargs.get("forward_only", False):
            return schedule(*args, **kwargs)
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        framework = "megatron" if "megatron.training.global_vars" in sys.modules else "megatron-core"
        if not (s.open and s.explicit):
            s.begin(iteration_number(s), chunks, framework=framework)  # type: ignore[arg-type]
        try:
            return schedule(*args, **kwargs)
        finally:
            s.forward_backward_done()

    timed_schedule.__wrapped__ = schedule  # type: ignore[attr-defined]
    return timed_schedule


def _wrap_get_forward_backward_func(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Callable:
    return _timed(wrapped(*args, **kwargs))


def _wrap_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = perf_session.current()
    if s is None or _in_step[0]:
        return wrapped(*args, **kwargs)
    _in_step[0] = True
    try:
        out = wrapped(*args, **kwargs)
    finally:
        _in_step[0] = False
    if not s.explicit:
        s.end()
    return out


def perf_patches() -> list[Patch]:
    """The Megatron patches of the perf recording (see the module docstring)."""
    steps = [Patch(
        name=f"megatron.perf.{cls}.step",
        target=f"{_OPTIMIZER}:{cls}.step",
        kind=WRAP,
        impl=_wrap_step,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="The perf recording ends the timed iteration after the optimizer's step (PORTSPEED_PERF is set).",
    ) for cls in ("MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer")]
    return [Patch(
        name="megatron.perf.get_forward_backward_func",
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        kind=WRAP,
        impl=_wrap_get_forward_backward_func,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="A training call of Megatron's schedule is an iteration's forward and backward: the perf recording "
               "times it on its model chunks (PORTSPEED_PERF is set).",
    ), *steps]
