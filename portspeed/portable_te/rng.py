"""TE's RNG tracker (``te.pytorch.distributed.CudaRNGStatesTracker``) and ``checkpoint`` (full recompute).

Why: Megatron subclasses the tracker as ``TECudaRNGStatesTracker`` (``--te-rng-tracker``) and
calls ``checkpoint`` through ``te_checkpoint``. The tracker keeps named generator states and
swaps them in and out of the active adapter's default generator (on CPU: the one CPU
generator) in ``fork(name)``, restoring the caller's state afterwards, as Megatron's own
tracker does. ``checkpoint`` recomputes the forward in the backward pass with the RNG states
of the first forward (the adapter generator, the CPU generator and every tracked state), so
dropout masks are the same both times. ``distribute_saved_activations`` (spreading the saved
input across the tensor-parallel group) is refused.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from portspeed.accelerator import get_accelerator

from .refuse import refuse_if

__all__ = ["CudaRNGStatesTracker", "checkpoint"]

_DEFAULT = "model-parallel-rng"


class CudaRNGStatesTracker:
    """Named generator states, forked into the adapter's default generator."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        """Forget every state."""
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> state map."""
        return {k: v.clone() for k, v in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the name -> state map (a checkpoint restore)."""
        self.states_ = {k: v.clone() for k, v in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Track a new state ``name`` seeded with ``seed``; a seed or name used twice is an error."""
        if seed in self.seeds_:
            raise RuntimeError(f"seed {seed} already exists in the RNG tracker")
        if name in self.states_:
            raise RuntimeError(f"RNG state {name!r} already exists in the RNG tracker")
        self.seeds_.add(seed)
        acc = get_accelerator()
        saved = acc.get_rng_state()
        try:
            acc.manual_seed(seed)
            self.states_[name] = acc.get_rng_state()
        finally:
            acc.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = _DEFAULT) -> Iterator[None]:
        """Run the block with state ``name`` in the adapter's generator; keep its advance; restore the caller's."""
        if name not in self.states_:
            raise KeyError(f"RNG state {name!r} is not added to the tracker (known: {sorted(self.states_)})")
        acc = get_accelerator()
        saved = acc.get_rng_state()
        acc.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = acc.get_rng_state()
            acc.set_rng_state(saved)


def _rng_snapshot(tracker: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None]:
    acc = get_accelerator()
    return torch.get_rng_state(), acc.get_rng_state(), (tracker.get_states() if tracker is not None else None)


def _rng_restore(snapshot: tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor] | None], tracker: Any) -> None:
    cpu, dev, states = snapshot
    torch.set_rng_state(cpu)
    get_accelerator().set_rng_state(dev)
    if tracker is not None and states is not None:
        tracker.set_states(states)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, function: Callable, tracker_fn: Callable | None, *args: Any) -> Any:
        ctx.function, ctx.tracker_fn = function, tracker_fn
        tracker = tracker_fn() if tracker_fn is not None else None
        ctx.rng = _rng_snapshot(tracker)
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        ctx.layout = [isinstance(a, torch.Tensor) for a in args]
        ctx.others = [a for a in args if not isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*tensors)
        with torch.no_grad():
            return function(*args)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:
        tensors, others = iter(ctx.saved_tensors), iter(ctx.others)
        inputs: list[Any] = []
        for is_tensor in ctx.layout:
            if is_tensor:
                t = next(tensors)
                inputs.append(t.detach().requires_grad_(t.requires_grad))
            else:
                inputs.append(next(others))
        tracker = ctx.tracker_fn() if ctx.tracker_fn is not None else None
        now = _rng_snapshot(tracker)
        _rng_restore(ctx.rng, tracker)
        try:
            with torch.enable_grad():
                outputs = ctx.function(*inputs)
        finally:
            _rng_restore(now, tracker)
        if isinstance(outputs, torch.Tensor):
            outputs = (outputs,)
        pairs = [(o, g) for o, g in zip(outputs, grads) if isinstance(o, torch.Tensor) and o.requires_grad]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        return (None, None) + tuple(x.grad if isinstance(x, torch.Tensor) else None for x in inputs)


def checkpoint(function: Callable, *args: Any, distribute_saved_activations: bool = False,
               get_rng_state_tracker: Callable | None = None, tp_group: Any = None, use_reentrant: bool = True,
               **kwargs: Any) -> Any:
    """Run ``function(*args, **kwargs)`` without keeping its activations; recompute them in the backward pass."""
    refuse_if(distribute_saved_activations, "distributing saved activations across tensor-parallel ranks "
              "(--distribute-saved-activations)", "drop --distribute-saved-activations")
    if kwargs:
        keys = list(kwargs)
        values = [kwargs[k] for k in keys]
        n = len(args)

        def call(*flat: Any) -> Any:
            return function(*flat[:n], **dict(zip(keys, flat[n:])))

        return _Recompute.apply(call, get_rng_state_tracker, *args, *values)
    return _Recompute.apply(function, get_rng_state_tracker, *args)
