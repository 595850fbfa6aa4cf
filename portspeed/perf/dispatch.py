"""What each module made the host wait for, seen below autograd: host syncs, host<->device copies, CPU fallbacks.

Why a dispatch mode: ``.item()`` becomes ``aten::_local_scalar_dense``, ``.cpu()`` / ``.to()`` become
``aten::_to_copy`` or ``aten::copy_`` across devices, and an op with no kernel for a PrivateUse1 device
runs through torch's CPU fallback without a word; only the dispatcher sees all three, under the module
that caused them (the probe's op level uses a ``TorchFunctionMode``, which sees torch's Python API, not
what it becomes). ``HostWatch`` is a ``TorchDispatchMode`` entered for the forward and backward of a
timed iteration; each op it sees is charged to the innermost open span (``portspeed.perf.spans``):

- ``syncs``: ``.item()`` (``_local_scalar_dense``) and data-dependent shapes (``nonzero``,
  ``masked_select``, ``unique``...) on a device tensor; a device-to-host copy is also a sync;
- ``copies``: ``d2h`` / ``h2d`` counts and bytes;
- ``fallbacks``: ops on a PrivateUse1 device tensor that have no kernel registered for the
  PrivateUse1 key (``torch._C._dispatch_has_kernel_for_dispatch_key``), by op name, except views and
  copies (``moves_no_data``: torch's own kernels serve them on the device, no arithmetic reaches the fallback);
- at op level, each op's start and end stamps (``ops``).

"A device tensor" is one on the active adapter's device type (on the CPU adapter, the host: its
``.item()`` waits for nothing, but it would on a device, so it is counted).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostWatch", "SYNC_OPS"]

_aten = torch.ops.aten
#: ops that make the host wait for the device, and how the report names them
SYNC_OPS: dict[Any, str] = {
    _aten._local_scalar_dense.default: ".item()",
    _aten.nonzero.default: "nonzero",
    _aten.masked_select.default: "masked_select",
    _aten.is_nonzero.default: ".item()",
}
for _name in ("_unique2", "unique_consecutive", "unique_dim"):
    _op = getattr(_aten, _name, None)
    if _op is not None:
        SYNC_OPS[_op.default] = "unique"
_COPIES = {_aten._to_copy.default, _aten.copy_.default}
_WATCHED = frozenset(SYNC_OPS) | _COPIES


#: ops that only allocate or copy: torch's composite kernels serve them with the device's allocator and copy
_COPY_OPS = frozenset({"_unsafe_view", "copy_", "_to_copy", "clone", "_copy_from", "_copy_from_and_resize",
                       "empty_like", "new_empty", "new_empty_strided", "empty_strided", "lift_fresh"})


def moves_no_data(func: Any) -> bool:
    """Whether ``func`` is a view (its results alias an input, nothing written) or an allocation or copy: no CPU
    fallback even without a PrivateUse1 kernel of its own."""
    rets = func._schema.returns
    if rets and all(r.alias_info is not None and not r.alias_info.is_write for r in rets):
        return True
    return func.name().split("::")[-1].split(".")[0] in _COPY_OPS


def _first_tensor(args: tuple) -> torch.Tensor | None:
    for a in args:
        if isinstance(a, torch.Tensor):
            return a
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b
    return None


class HostWatch(TorchDispatchMode):
    """The dispatch mode of one iteration (see the module docstring); ``charge()`` is the span ops go to."""

    def __init__(self, charge: Callable[[], Any], device_type: str, op_level: bool, stamp: Callable[[], Any]) -> None:
        super().__init__()
        self.charge, self.device_type, self.op_level, self.stamp = charge, device_type, op_level, stamp
        self.private = device_type == torch._C._get_privateuse1_backend_name()
        self.slow = self.private or op_level  # every op is looked at (CPU fallbacks, op times)
        self._has_kernel: dict[Any, bool] = {}

    def _no_kernel(self, func: Any) -> bool:
        got = self._has_kernel.get(func)
        if got is None:
            try:
                got = bool(torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), "PrivateUse1"))
                got = got or moves_no_data(func)
            except Exception:  # an op the dispatcher cannot name: not counted
                got = True
            self._has_kernel[func] = got
        return not got

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.slow and func not in _WATCHED:  # the common op at module level off a PrivateUse1 device
            return func(*args, **kwargs)
        span = self.charge()
        if span is None:
            return func(*args, **kwargs)
        first = _first_tensor(args)
        on_device = first is not None and first.device.type == self.device_type
        sync = SYNC_OPS.get(func)
        if sync is not None and on_device:
            span.count("syncs", sync)
        elif func in _COPIES:
            self._copy(span, func, args, kwargs)
        if self.private and on_device and self._no_kernel(func):
            span.count("fallbacks", func.name().split("::")[-1].split(".")[0])
        if not self.op_level:
            return func(*args, **kwargs)
        t0 = self.stamp()
        out = func(*args, **kwargs)
        span.ops.append((func.name(), t0, self.stamp()))
        return out

    def _copy(self, span: Any, func: Any, args: tuple, kwargs: dict) -> None:
        if func is _aten._to_copy.default:
            src = args[0]
            dst_device = kwargs.get("device")
            if dst_device is None:
                return
            dst_type = torch.device(dst_device).type
        else:
            dst, src = args[0], args[1]
            dst_type = dst.device.type
        if not isinstance(src, torch.Tensor) or src.device.type == dst_type:
            return
        kind = "d2h" if dst_type == "cpu" else "h2d" if src.device.type == "cpu" else "d2d"
        span.add_copy(kind, src.numel() * src.element_size())
        if kind == "d2h" and src.device.type == self.device_type:
            span.count("syncs", "device-to-host copy")
