"""Megatron's iterations, seen by the probe with no edit to the training script (declared only when probing is on).

An iteration of Megatron-LM's ``train_step`` and of a Megatron-Core loop (the example trainer) is
one training call of the function ``get_forward_backward_func()`` returns (``forward_only=False``;
evaluation's calls are left alone) followed by one ``step()`` of the outermost Megatron optimizer
(a ``ChainedOptimizer``'s own step, not its members'). So:

- ``get_forward_backward_func`` is wrapped to hand back a probed schedule: it begins the
  iteration on the ``model`` argument (the model chunks in order; each chunk's forward call is a
  micro-batch of that chunk), runs the schedule unchanged and marks its end; if the schedule raises
  while ``--probe-nan`` watches, the non-finite value is named before the error goes on;
- the optimizers' ``step`` records every parameter's gradient before and every parameter after
  (``portspeed.probe.params``: main_grad, the distributed optimizer's shards), then ends the
  iteration (its dump, the NaN check).

The iteration's number: ``megatron.training``'s ``args.curr_iteration + 1`` when it drives the loop
(stock ``pretrain_gpt.py``: the number Megatron prints), else the count of training calls in this
process (a loop that resumes from a checkpoint counts from 1 again: mark iterations with
``portspeed.probe.iteration(n, model)``, which wins over this count).

These patches are not in ``all_patches()`` (this module has no ``PATCHES``): ``probe_patches()`` is
registered by the Megatron integration only when ``PORTSPEED_PROBE_DIR`` is set, so probing off
installs nothing.
"""

from __future__ import annotations

import functools
import sys
from typing import Any, Callable

from portspeed.patching.record import WRAP, Patch
from portspeed.probe import session as probe_session

from .ranges import CORE, DISTRIBUTION

__all__ = ["probe_patches", "iteration_number"]

_OPTIMIZER = "megatron.core.optimizer.optimizer"
_in_step = [False]


def iteration_number(session: probe_session.ProbeSession) -> int:
    """The iteration a training call starts: megatron.training's, else one more than the last begun."""
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    current = getattr(args, "curr_iteration", None)
    if isinstance(current, int) and not isinstance(current, bool):
        return current + 1
    return session.last + 1


def _dp_order(dp: int) -> str:
    gv = sys.modules.get("megatron.training.global_vars")
    args = getattr(gv, "_GLOBAL_ARGS", None) if gv is not None else None
    kind = getattr(args, "dataloader_type", None)
    if kind in ("single", "cyclic"):
        return kind
    declared = getattr(sys.modules.get("__main__"), "PORTSPEED_PROBE_DP_ORDER", None)
    if declared in ("contiguous", "single", "cyclic"):
        return declared
    return "contiguous" if dp == 1 else "unknown"


def _context(kwargs: dict[str, Any], chunks: list) -> dict[str, Any]:
    """What the schedule's arguments and Megatron's state say about the batch and the gradients' scale."""
    ps = sys.modules.get("megatron.core.parallel_state")
    dp = cp = 1
    try:
        if ps is not None and ps.model_parallel_is_initialized():
            dp, cp = ps.get_data_parallel_world_size(), ps.get_context_parallel_world_size()
    except Exception:  # torn down between iterations: the sizes are the defaults
        pass
    config = getattr(chunks[0], "config", None) if chunks else None
    per_token = bool(getattr(config, "calculate_per_token_loss", False))
    return {"micro_batch_size": kwargs.get("micro_batch_size"), "seq_length": kwargs.get("seq_length"),
            "num_microbatches": kwargs.get("num_microbatches"), "dp_order": _dp_order(dp),
            # each micro-batch's loss is divided by the micro-batches per rank, not over the global batch, and
            # multiplied by cp: an activation's gradient is dp x cp times its share of the global mean loss
            "grad_scale": None if per_token else float(dp * cp)}


def _probed(schedule: Callable) -> Callable:
    @functools.wraps(schedule)
    def probed_schedule(*args: Any, **kwargs: Any) -> Any:
        s = probe_session.current()
        if s is None or kwargs.get("forward_only", False):
            return schedule(*args, **kwargs)
        model = kwargs.get("model", args[2] if len(args) > 2 else None)
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        framework = "megatron" if "megatron.training.global_vars" in sys.modules else "megatron-core"
        if s.record is None or not s.explicit:
            s.begin(iteration_number(s), chunks, framework=framework, context=_context(kwargs, chunks))
        try:
            out = schedule(*args, **kwargs)
        except BaseException:
            if s.settings.probe_nan:
                s.end()  # names the first non-finite value and exits, if there is one
            raise
        s.forward_backward_done()
        return out

    probed_schedule.__wrapped__ = schedule  # type: ignore[attr-defined]
    return probed_schedule


def _wrap_get_forward_backward_func(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Callable:
    return _probed(wrapped(*args, **kwargs))


def _wrap_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = probe_session.current()
    if s is None or _in_step[0]:
        return wrapped(*args, **kwargs)
    _in_step[0] = True
    try:
        s.before_step(instance)
        out = wrapped(*args, **kwargs)
        s.after_step(instance)
    finally:
        _in_step[0] = False
    if not s.explicit:
        s.end()
    return out


def probe_patches() -> list[Patch]:
    """The Megatron patches of the probe (see the module docstring)."""
    steps = [Patch(
        name=f"megatron.probe.{cls}.step",
        target=f"{_OPTIMIZER}:{cls}.step",
        kind=WRAP,
        impl=_wrap_step,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="The probe records every parameter's gradient before the optimizer step and its value after, and "
               "ends the iteration there (PORTSPEED_PROBE_DIR is set).",
    ) for cls in ("MixedPrecisionOptimizer", "FP32Optimizer", "ChainedOptimizer")]
    return [Patch(
        name="megatron.probe.get_forward_backward_func",
        target="megatron.core.pipeline_parallel.schedules:get_forward_backward_func",
        kind=WRAP,
        impl=_wrap_get_forward_backward_func,
        distribution=DISTRIBUTION,
        versions=CORE,
        reason="A training call of Megatron's schedule is an iteration's forward and backward: the probe begins "
               "the iteration on its model chunks (PORTSPEED_PROBE_DIR is set).",
    ), *steps]
