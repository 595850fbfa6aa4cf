"""Parameter identity on an out-of-tree device: ``module.to(device)`` keeps its Parameter objects.

Why: ``torch.nn.Module._apply`` keeps a Parameter object (and the attributes frameworks hang on it: Megatron's
``tensor_model_parallel``, ``partition_dim``, ``sequence_parallel``...) only where
``torch._has_compatible_shallow_copy_type(param, moved)`` is True; otherwise it makes a new Parameter and the
attributes are lost, so TP2 quietly parts from TP1. The same answer gates ``param.data = t``
(``variable.set_data``), which then raises. torch answers True between a host tensor and a CUDA/XPU/... one,
but its list of dense backends does not name PrivateUse1: a vendor's device that registers no
``_has_compatible_shallow_copy_type`` kernel (OpenReg on torch 2.13 does not) gets False.

What: ``ensure(acc)``, at the adapter's selection, asks the dispatcher that question for a host and a device
tensor. Only where the answer is False, and the device is torch's PrivateUse1 device, it registers a PrivateUse1
kernel (``torch.library``) answering True between dense strided host and device tensors, as torch answers for
CUDA; every other pair gets torch's own rule. Gated on that detected answer, never on a device name; a device
that answers True already is left alone. ``state()`` says what was found and done (``portspeed conformance``
reports it).

Limits: a registration cannot be undone in a process (torch's dispatcher keeps it for the library's lifetime:
the library object is kept here).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["ensure", "lacks_shallow_copy", "state"]

log = logging.getLogger("portspeed")

_OP = "_has_compatible_shallow_copy_type"
_library: Any = None
_state: dict[str, Any] = {}


def lacks_shallow_copy(device: torch.device) -> bool | None:
    """Whether torch answers False for a host tensor and a ``device`` tensor (None: the device cannot be asked)."""
    try:
        host, dev = torch.empty(1), torch.empty(1, device=device)
        return not torch._has_compatible_shallow_copy_type(host, dev)
    except Exception:  # a fake or missing runtime: nothing to detect, nothing to fix
        return None


def _dense(t: torch.Tensor, device_type: str) -> bool:
    return t.layout == torch.strided and not t.is_quantized and t.device.type in ("cpu", device_type)


def _register(device_type: str) -> None:
    global _library

    def compatible(self: torch.Tensor, other: torch.Tensor) -> bool:
        if _dense(self, device_type) and _dense(other, device_type):
            return True
        return self.device.type == other.device.type and self.layout == other.layout  # torch's rule, elsewhere

    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - an aten kernel for the PrivateUse1 key only
    lib.impl(_OP, compatible, "PrivateUse1")
    _library = lib


def ensure(acc: Any) -> dict[str, Any]:
    """Detect, once per device type, whether ``acc``'s device lacks the kernel; register it where it does."""
    device_type = getattr(acc, "device_type", "")
    if _state.get("device_type") == device_type:
        return dict(_state)
    found: dict[str, Any] = {"device_type": device_type, "lacked": False, "registered": False}
    if device_type and device_type != "cpu" and not acc.device_is_host and \
            torch._C._get_privateuse1_backend_name() == device_type:
        lacked = lacks_shallow_copy(torch.device(device_type, 0))
        found["lacked"] = bool(lacked)
        if lacked:
            _register(device_type)
            found["registered"] = lacks_shallow_copy(torch.device(device_type, 0)) is False
            log.info("portspeed: device %r had no PrivateUse1 %s kernel (module.to(device) would make new "
                     "Parameters); registered one", device_type, _OP)
    _state.clear()
    _state.update(found)
    return dict(found)


def state() -> dict[str, Any]:
    """What ``ensure`` found and did: ``{"device_type", "lacked", "registered"}`` (empty before it ran)."""
    return dict(_state)
