"""The host rung: torch ops an adapter declares wrong on its device (``wrong_torch_ops``) computed on the host.

Why: conformance's kernels suite can find one of torch's own ops wrong on a device (a vendor's kernel, or what its
CPU fallback does with it). Megatron's local path and the portable TE send matmul, softmax, gelu, cross-entropy...
to torch on the device directly; the portable TE's kernel ladder has another rung only for attention and the norms,
and Megatron's local path calls the norms through torch (``torch.nn.LayerNorm`` / ``RMSNorm``). For those one rung
is right on every device that can copy to and from the host: the host itself.

What: ``HOST_OPS`` maps each name ``wrong_torch_ops`` may give (conformance's names) to the aten operators behind
it, forward and backward. ``ensure(acc)``, at the adapter's selection, registers for the device's dispatch key only
(``torch.library``) a kernel of each of those operators that copies its tensors to the host, runs torch's CPU kernel
and copies the results back to the device the inputs were on; autograd above it is torch's own. Gated on the
declaration, never on a device name. ``suspended()`` takes the registration away for a while, so conformance can
ask the device's own kernel whether the declaration is still needed.

Cost: two copies per call, the op at the host's speed; the perf recording shows it (the op runs on the host).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_leaves, tree_map

__all__ = ["HOST_OPS", "calls", "ensure", "registered", "suspended"]

log = logging.getLogger("portspeed")

#: a name of ``wrong_torch_ops`` served by the host rung -> the aten operators (default overloads) computed there
HOST_OPS: dict[str, tuple[str, ...]] = {
    "matmul": ("mm", "bmm"),
    "addmm": ("addmm",),
    "baddbmm": ("baddbmm",),
    "softmax": ("_softmax", "_softmax_backward_data"),
    "gelu": ("gelu", "gelu_backward"),
    "silu": ("silu", "silu_backward"),
    "cross_entropy": ("_log_softmax", "_log_softmax_backward_data", "nll_loss_forward", "nll_loss_backward"),
    "layer_norm": ("native_layer_norm", "native_layer_norm_backward"),
    "rms_norm": ("rms_norm",),
}
#: aten ops that torch composes of other ops on a PrivateUse1 device (rms_norm: pow, mean, rsqrt, mul on torch 2.13
#: and 2.15), so autograd never reaches the device's key with them: their host kernel is registered at the device's
#: autograd key too, and autograd differentiates the host's computation (the copies to and from the host included)
_AUTOGRAD_TOO = frozenset({"rms_norm"})
#: in-tree device types and their dispatch keys (any other device is torch's PrivateUse1 device, or not served)
_KEYS = {"cuda": "CUDA", "xpu": "XPU", "mps": "MPS", "hpu": "HPU", "mtia": "MTIA"}

_library: Any = None
_state: dict[str, Any] = {}
_calls: dict[str, int] = {}


def _dispatch_key(device_type: str) -> str | None:
    if device_type == torch._C._get_privateuse1_backend_name():
        return "PrivateUse1"
    return _KEYS.get(device_type)


def _on_host(op: Any) -> Callable[..., Any]:
    """A kernel of ``op`` that runs torch's CPU kernel on host copies and hands the results back to the device."""
    name = str(op.name()).removeprefix("aten::")

    def kernel(*args: Any, **kwargs: Any) -> Any:
        _calls[name] = _calls.get(name, 0) + 1
        device = next(t.device for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor) and t.device.type != "cpu")
        host_args, host_kwargs = tree_map(lambda t: t.cpu() if isinstance(t, torch.Tensor) else t, (args, kwargs))
        out = op(*host_args, **host_kwargs)
        return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, out)

    return kernel


def _register(key: str, names: tuple[str, ...]) -> None:
    global _library
    lib = torch.library.Library("aten", "IMPL")  # noqa: TOR901 - aten kernels for the device's key only
    for name in names:
        for aten in HOST_OPS[name]:
            kernel = _on_host(getattr(torch.ops.aten, aten).default)
            lib.impl(aten, kernel, key)
            if aten in _AUTOGRAD_TOO:
                lib.impl(aten, kernel, f"Autograd{key}")
    _library = lib


def _unregister() -> None:
    global _library
    if _library is not None:
        _library._destroy()
        _library = None


def ensure(acc: Any) -> dict[str, Any]:
    """Register the host rung for the ops ``acc`` declares wrong that ``HOST_OPS`` serves (once per adapter)."""
    names = tuple(n for n in getattr(acc, "wrong_torch_ops", ()) if n in HOST_OPS)
    device_type = getattr(acc, "device_type", "")
    wanted = {"device_type": device_type, "ops": names}
    if {k: _state.get(k) for k in wanted} == wanted:
        return dict(_state)
    _unregister()
    key = _dispatch_key(device_type) if names and not acc.device_is_host else None
    if key is not None:
        _register(key, names)
        log.info("portspeed: %s on %r computed on the host (declared in wrong_torch_ops)", ", ".join(names),
                 device_type)
    _state.clear()
    _state.update(wanted, key=key)
    return dict(_state)


def registered() -> tuple[str, ...]:
    """The ``wrong_torch_ops`` names the host rung serves now (empty while suspended or before ``ensure``)."""
    return tuple(_state.get("ops", ())) if _library is not None else ()


def calls() -> dict[str, int]:
    """How many times each aten operator ran on the host rung in this process (the perf line of host fallbacks)."""
    return dict(_calls)


@contextlib.contextmanager
def suspended() -> Iterator[None]:
    """The device's own kernels for a while (conformance asks them whether a declaration is still needed)."""
    names, key = tuple(_state.get("ops", ())), _state.get("key")
    if _library is None or key is None:
        yield
        return
    _unregister()
    try:
        yield
    finally:
        _register(key, names)
