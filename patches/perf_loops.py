"""Where DeepSpeed's and the Hugging Face Trainer's iterations begin and end, for the perf recording (declared only
when ``PORTSPEED_PERF`` is set: ``patches/perf.py``).

The probe's boundaries (``patches/probe_loops.py`` says why): DeepSpeed's iteration is a gradient
accumulation cycle, numbered ``engine.global_steps + 1``, begun by its first ``DeepSpeedEngine.forward``
on the engine's module; the ``engine.step()`` at the accumulation boundary ends its forward/backward
before the optimizer runs and the iteration after it. The Hugging Face Trainer: a callback added in
``Trainer.__init__`` begins iteration ``state.global_step + 1`` at ``on_step_begin``, ends the
forward/backward at ``on_pre_optimizer_step`` and the iteration at ``on_step_end`` (under DeepSpeed the
callback's iteration is the one the engine's patches see: they defer to it).
"""

from __future__ import annotations

from typing import Any, Callable

from portspeed.patching.record import WRAP, Patch
from portspeed.perf import session as perf_session

__all__ = ["deepspeed_patches", "trainer_patches"]

_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"


def _engine_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = perf_session.current()
    if s is not None and not (s.open and s.explicit):
        n = int(getattr(instance, "global_steps", 0)) + 1
        if s.last != n:  # the cycle's first micro-batch
            s.begin(n, [instance], framework="deepspeed")
    return wrapped(*args, **kwargs)


def _engine_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = perf_session.current()
    if s is None or s.explicit or not getattr(instance, "is_gradient_accumulation_boundary", lambda: True)():
        return wrapped(*args, **kwargs)
    s.forward_backward_done()
    out = wrapped(*args, **kwargs)
    s.end()
    return out


def deepspeed_patches() -> list[Patch]:
    """DeepSpeedEngine.forward and .step (see the module docstring)."""
    return [
        Patch(name="deepspeed.perf.DeepSpeedEngine.forward", target=f"{_ENGINE}.forward", kind=WRAP,
              impl=_engine_forward, distribution="deepspeed", versions=">=0.14",
              reason="The perf recording begins DeepSpeed's iteration (global_steps + 1) at its first micro-batch's "
                     "forward (PORTSPEED_PERF is set)."),
        Patch(name="deepspeed.perf.DeepSpeedEngine.step", target=f"{_ENGINE}.step", kind=WRAP,
              impl=_engine_step, distribution="deepspeed", versions=">=0.14",
              reason="The perf recording ends DeepSpeed's iteration at the gradient accumulation boundary's step "
                     "(PORTSPEED_PERF is set)."),
    ]


def _callback() -> Any:
    """A TrainerCallback (transformers is imported: the Trainer is being made) driving the perf session."""
    from transformers import TrainerCallback

    class PerfCallback(TrainerCallback):
        """portspeed's perf recording: one Trainer step is one iteration (``state.global_step + 1``)."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = perf_session.current()
            if s is not None and kwargs.get("model") is not None:
                s.begin(int(state.global_step) + 1, [kwargs["model"]], framework="hf-trainer", explicit=True)

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = perf_session.current()
            if s is not None:
                s.forward_backward_done()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = perf_session.current()
            if s is not None:
                s.end()

    return PerfCallback()


def _trainer_init(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    if perf_session.current() is not None:
        instance.add_callback(_callback())
    return out


def trainer_patches() -> list[Patch]:
    """Trainer.__init__ adds the perf recording's callback (see the module docstring)."""
    return [Patch(name="transformers.perf.Trainer.callback", target="transformers.trainer:Trainer.__init__",
                  kind=WRAP, impl=_trainer_init, distribution="transformers", versions=">=4.40",
                  reason="The perf recording marks each Trainer step as an iteration through a callback "
                         "(PORTSPEED_PERF is set).")]
