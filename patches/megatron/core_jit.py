"""Megatron's ``jit_fuser`` runs eagerly on a device torch.compile cannot generate code for.

Megatron decorates its small fusions (bias-GeLU, bias-dropout-add, ...) with
``megatron.core.jit.jit_fuser``, which is ``torch.compile`` on torch >= 2.2, and Megatron-LM
calls them at start-up (``_warmup_jit_function``). Inductor has code generators for CPU,
CUDA, XPU and MPS, and for devices whose vendor registered one; on any other device the
first call fails inside Inductor (``KeyError: '<device>'``, met on the test device). There
the decorator returns the function unchanged (what Megatron's own ``disable_jit_fuser()``
does), so the same functions run as eager torch ops. Where Inductor knows the device,
nothing changes.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from portspeed.accelerator import Accelerator
from portspeed.patching.record import REPLACE, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "eager_jit_fuser", "inductor_lacks_device"]

log = logging.getLogger("portspeed.megatron")

#: devices Inductor ships code generators for (no need to import Inductor to know)
_INDUCTOR_DEVICES = frozenset({"cpu", "cuda", "xpu", "mps"})


def inductor_lacks_device(acc: Accelerator) -> bool:
    """Condition: torch.compile's Inductor has no code generator for the adapter's device."""
    if acc.device_type in _INDUCTOR_DEVICES:
        return False
    try:
        from torch._inductor.codegen.common import get_scheduling_for_device
    except ImportError:  # pragma: no cover - a torch without Inductor: nothing compiles there either
        return True
    return get_scheduling_for_device(acc.device_type) is None


def eager_jit_fuser(fn: Callable[..., Any] | None = None, *args: Any, **kwargs: Any) -> Any:
    """``jit_fuser`` replacement: the decorated function itself (also as ``jit_fuser(**options)(fn)``)."""
    if fn is None:
        return lambda f: f
    return fn


PATCHES: list[Patch] = [
    Patch(name="megatron.core.jit_fuser.eager", target="megatron.core.jit:jit_fuser", kind=REPLACE,
          impl=eager_jit_fuser,
          reason="torch.compile has no Inductor code generator for this device; Megatron's fusions run as eager "
                 "torch ops (as with Megatron's disable_jit_fuser())",
          distribution=DISTRIBUTION, versions=CORE, when=inductor_lacks_device),
]
