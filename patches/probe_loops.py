"""Where DeepSpeed's and the Hugging Face Trainer's iterations begin and end, for the probe (declared only when
``PORTSPEED_PROBE_DIR`` is set: ``patches/probe.py``).

DeepSpeed: an iteration is a gradient accumulation cycle, numbered ``engine.global_steps + 1``; its first
``DeepSpeedEngine.forward`` begins it on the engine's module (each forward is a micro-batch), and the
``engine.step()`` at the accumulation boundary ends it (parameters' gradients before, values after); the
other ``step()`` calls of the cycle only count micro-batches inside DeepSpeed and are passed through.
Limits: with ZeRO-2 or 3 the gradients live in the optimizer's partitions (``param.grad`` is None), so
no parameter gradient is recorded (reading them would gather across ranks); ZeRO-3's parameters
after the step are this rank's partition. DeepSpeed's ``PipelineEngine.train_batch`` is not seen.

The Hugging Face Trainer (with or without DeepSpeed): ``Trainer.__init__`` adds a callback whose
``on_step_begin`` begins iteration ``state.global_step + 1`` on the Trainer's model,
``on_pre_optimizer_step`` / ``on_optimizer_step`` record the parameters around the optimizer's step,
and ``on_step_end`` ends the iteration. Under DeepSpeed the callback's iteration is the one the engine's
patches see (they defer to it).
"""

from __future__ import annotations

from typing import Any, Callable

from portspeed.patching.record import WRAP, Patch
from portspeed.probe import session as probe_session

__all__ = ["deepspeed_patches", "trainer_patches"]

_ENGINE = "deepspeed.runtime.engine:DeepSpeedEngine"


def _engine_forward(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = probe_session.current()
    if s is not None and not (s.record is not None and s.explicit):
        n = int(getattr(instance, "global_steps", 0)) + 1
        if s.last != n:  # the cycle's first micro-batch
            s.begin(n, [instance], framework="deepspeed", context={"dp_order": "unknown"})
            s.first_micro_batch(0)  # this forward's pre-hook ran before the hooks were installed
    return wrapped(*args, **kwargs)


def _engine_step(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    s = probe_session.current()
    if s is None or not getattr(instance, "is_gradient_accumulation_boundary", lambda: True)():
        return wrapped(*args, **kwargs)
    s.before_step()
    out = wrapped(*args, **kwargs)
    s.after_step()
    if not s.explicit:
        s.end()
    return out


def deepspeed_patches() -> list[Patch]:
    """DeepSpeedEngine.forward and .step (see the module docstring)."""
    return [
        Patch(name="deepspeed.probe.DeepSpeedEngine.forward", target=f"{_ENGINE}.forward", kind=WRAP,
              impl=_engine_forward, distribution="deepspeed", versions=">=0.14",
              reason="The probe begins DeepSpeed's iteration (global_steps + 1) at its first micro-batch's forward "
                     "(PORTSPEED_PROBE_DIR is set)."),
        Patch(name="deepspeed.probe.DeepSpeedEngine.step", target=f"{_ENGINE}.step", kind=WRAP,
              impl=_engine_step, distribution="deepspeed", versions=">=0.14",
              reason="The probe ends DeepSpeed's iteration at the gradient accumulation boundary's step, with the "
                     "parameters around it (PORTSPEED_PROBE_DIR is set)."),
    ]


def _callback() -> Any:
    """A TrainerCallback (transformers is imported: the Trainer is being made) driving the probe session."""
    from transformers import TrainerCallback

    class ProbeCallback(TrainerCallback):
        """portspeed's probe: one Trainer step is one iteration (``state.global_step + 1``)."""

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = probe_session.current()
            if s is not None and kwargs.get("model") is not None:
                s.begin(int(state.global_step) + 1, [kwargs["model"]], framework="hf-trainer", explicit=True,
                        context={"micro_batch_size": getattr(args, "per_device_train_batch_size", None),
                                 "dp_order": "unknown"})

        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = probe_session.current()
            if s is not None:
                s.before_step()

        def on_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = probe_session.current()
            if s is not None:
                s.after_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            s = probe_session.current()
            if s is not None:
                s.end()

    return ProbeCallback()


def _trainer_init(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    out = wrapped(*args, **kwargs)
    if probe_session.current() is not None:
        instance.add_callback(_callback())
    return out


def trainer_patches() -> list[Patch]:
    """Trainer.__init__ adds the probe's callback (see the module docstring)."""
    return [Patch(name="transformers.probe.Trainer.callback", target="transformers.trainer:Trainer.__init__",
                  kind=WRAP, impl=_trainer_init, distribution="transformers", versions=">=4.40",
                  reason="The probe marks each Trainer step as an iteration through a callback "
                         "(PORTSPEED_PROBE_DIR is set).")]
