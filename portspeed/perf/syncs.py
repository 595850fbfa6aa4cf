"""Host syncs and copies at module level, seen at torch's Tensor methods: the cheap path where no op needs a look.

Why not always the dispatch mode (``portspeed.perf.dispatch``): a ``TorchDispatchMode`` puts a Python call in
front of every operator, which on the example trainer's CPU step cost half the step by itself
(docs/benchmarks.md); at module level on a device with kernels for every op (CPU, CUDA, a vendor's own
device type) there is no CPU fallback to count, and the host syncs a training script makes are calls of a
few Tensor methods. ``MethodWatch`` wraps those for the forward and backward of a timed iteration (installed
on ``torch.Tensor`` at the iteration's start, the originals put back when the schedule returns) and charges
each call to the innermost open span, as the dispatch mode does:

- ``.item()``, ``.tolist()``, ``.nonzero()`` on a device tensor: a host sync;
- ``.cpu()`` / ``.to(cpu)`` of a device tensor: a device-to-host copy (and a sync), ``.to(device)`` of a
  host tensor: a host-to-device copy (on a device that is the host there are none).

It does not see what C++ does without passing through these methods (``if tensor:``, ``torch.nonzero``,
an op's own host read); the dispatch mode does, and it is what ``--perf-level op`` and a PrivateUse1 device
(whose CPU fallbacks are counted) get.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

__all__ = ["MethodWatch"]

#: Tensor method -> how a sync through it is named
_SYNCS = {"item": ".item()", "tolist": ".tolist()", "nonzero": "nonzero"}
_MOVES = ("cpu", "to")


def _target_device(name: str, args: tuple, kwargs: dict) -> str | None:
    """The device type a ``.cpu()`` / ``.to(...)`` call moves to (None: no move)."""
    if name == "cpu":
        return "cpu"
    dev = kwargs.get("device")
    if dev is None:
        for a in args:
            if isinstance(a, (str, torch.device)):
                dev = a
                break
            if isinstance(a, torch.Tensor):
                return a.device.type
    if dev is None:
        return None
    try:
        return torch.device(dev).type
    except (RuntimeError, TypeError):
        return None


class MethodWatch:
    """The Tensor-method wrappers of one iteration (see the module docstring)."""

    def __init__(self, charge: Callable[[], Any], device_type: str) -> None:
        self.charge, self.device_type = charge, device_type
        self._originals: dict[str, Any] = {}

    def install(self) -> "MethodWatch":
        for name in (*_SYNCS, *_MOVES):
            original = getattr(torch.Tensor, name)
            self._originals[name] = original
            setattr(torch.Tensor, name, self._wrap(name, original))
        return self

    def remove(self) -> None:
        for name, original in self._originals.items():
            setattr(torch.Tensor, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        watch = self
        sync = _SYNCS.get(name)

        @functools.wraps(original)
        def wrapper(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            span = watch.charge()
            if span is not None and tensor.device.type == watch.device_type:
                if sync is not None:
                    span.count("syncs", sync)
                elif watch.device_type != "cpu" and _target_device(name, args, kwargs) == "cpu":
                    span.add_copy("d2h", tensor.numel() * tensor.element_size())
                    span.count("syncs", "device-to-host copy")
            elif span is not None and name == "to" and tensor.device.type == "cpu" and watch.device_type != "cpu":
                if _target_device(name, args, kwargs) == watch.device_type:
                    span.add_copy("h2d", tensor.numel() * tensor.element_size())
            return original(tensor, *args, **kwargs)

        return wrapper
