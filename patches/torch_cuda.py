"""Tensor / Module device methods that name CUDA, translated for framework callers only.

``x.cuda()``, ``x.to("cuda")``, ``x.new_empty(..., device=torch.cuda.current_device())``, ``module.cuda()``
and ``t.type() == 'torch.cuda.FloatTensor'``
live on torch's classes, out of reach of the scoped torch view, so they are patched here
(``Tensor.to`` and ``Tensor.type`` are replaced by plain functions calling torch's C methods,
because torch itself calls them constantly and a wrapt wrapper costs ~1.5 us per call; the
rarely called ones are wrapped).
Each wrapper translates only when (a) the adapter does not run CUDA natively (the ``when``
condition ``conditions.translated``: on CUDA and ROCm these patches are inactive), (b) the
call names CUDA and (c) the caller is a framework module (see
``portspeed.translation.importer.is_framework_module``). The caller's frame is looked at only after (a) and (b) hold,
so the common path costs a type check per argument. Everything else gets torch's own behaviour, errors included.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.translation.torch_namespace import names_cuda, translate_device
from portspeed.translation.scope import FRAMEWORK_ENV, is_framework_module
from portspeed.translation.importer import caller_is_framework
from portspeed.patching.record import REPLACE, WRAP, Patch

__all__ = ["PATCHES", "cuda_type_string", "local_type_string", "tensor_to", "tensor_type"]


def _translate_call(args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
    """Translated (args, kwargs) when any device argument names CUDA, else None (fast path)."""
    hit = False
    for a in args:
        if names_cuda(a):
            hit = True
            break
    d = kwargs.get("device")
    if not hit and (d is None or not names_cuda(d)):
        return None
    new_args = tuple(translate_device(a) if names_cuda(a) else a for a in args)
    if d is not None:
        kwargs = dict(kwargs, device=translate_device(d))
    return new_args, kwargs


def _to(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Module.to: a CUDA device from a framework caller goes to the adapter's device."""
    if args or kwargs:
        t = _translate_call(args, kwargs)
        if t is not None and caller_is_framework(2):
            return wrapped(*t[0], **t[1])
    return wrapped(*args, **kwargs)


_DEVICE = torch.device
_BASE_TO = vars(torch._C.TensorBase)["to"]
_BASE_TYPE = vars(torch._C.TensorBase)["type"]


def tensor_to(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """Tensor.to (replacement; a plain function because torch calls .to everywhere, so wrapt's cost counts).

    The fast path is one type check per argument; only a CUDA-naming call from a framework
    module is translated.
    """
    for a in args:
        t = type(a)
        if (t is str and a.startswith("cuda")) or (t is _DEVICE and a.type == "cuda") or t is int:
            break
    else:
        d = kwargs.get("device") if kwargs else None
        if d is None or not names_cuda(d):
            return _BASE_TO(self, *args, **kwargs)
    if caller_is_framework(2):
        t2 = _translate_call(args, kwargs)
        if t2 is not None:
            return _BASE_TO(self, *t2[0], **t2[1])
    return _BASE_TO(self, *args, **kwargs)


def _index(device: Any) -> int | None:
    if device is None:
        return None
    if isinstance(device, int):
        return device
    return torch.device(device).index


def _tensor_cuda(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Tensor.cuda(device=None, non_blocking=False): from framework code, move to the adapter's device."""
    if not caller_is_framework(2):
        return wrapped(*args, **kwargs)
    device = args[0] if args else kwargs.get("device")
    non_blocking = args[1] if len(args) > 1 else kwargs.get("non_blocking", False)
    target = get_accelerator().device(_index(device))
    memory_format = kwargs.get("memory_format")
    if memory_format is not None:
        return instance.to(target, non_blocking=non_blocking, memory_format=memory_format)
    return instance.to(target, non_blocking=non_blocking)


def _tensor_new(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Tensor.new_empty(size, *, device=...): a CUDA ``device`` from a framework caller is the adapter's device.

    Megatron's all-to-all-v (``tensor_parallel.mappings._AllToAll``, the MoE token dispatcher)
    allocates its output with ``device=torch.cuda.current_device()``: an int, which torch reads as
    the CUDA (or current accelerator) index, so off CUDA the call raised "Cannot access
    accelerator device when none is available" (CPU) or reached the CUDA runtime (CUDA build).
    """
    d = kwargs.get("device") if kwargs else None
    if d is not None and names_cuda(d) and caller_is_framework(2):
        kwargs = dict(kwargs, device=translate_device(d))
    return wrapped(*args, **kwargs)


def _module_cuda(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Module.cuda(device=None): from framework code, move parameters and buffers to the adapter's device."""
    if not caller_is_framework(2):
        return wrapped(*args, **kwargs)
    device = args[0] if args else kwargs.get("device")
    return instance.to(get_accelerator().device(_index(device)))


def cuda_type_string(s: str, device_type: str | None = None) -> str:
    """A tensor type string in CUDA spelling when it names the adapter's device, else unchanged.

    'torch.testdev.FloatTensor' -> 'torch.cuda.FloatTensor' on the 'testdev' adapter. A host
    type ('torch.FloatTensor') is the device's only on a host adapter (``device_type`` 'cpu',
    the default): on any other adapter a host tensor stays a host tensor, so framework code
    that checks ``t.type() == 'torch.cuda.FloatTensor'`` sees a tensor left on the host.
    """
    dt = "cpu" if device_type is None else device_type
    parts = s.split(".")
    if len(parts) == 2 and parts[0] == "torch":
        return f"torch.cuda.{parts[1]}" if dt == "cpu" else s
    if len(parts) == 3 and parts[0] == "torch" and parts[1] == dt:
        return f"torch.cuda.{parts[2]}"
    return s


def local_type_string(s: str) -> str:
    """'torch.cuda.FloatTensor' -> the adapter's spelling ('torch.FloatTensor' on CPU)."""
    if not s.startswith("torch.cuda."):
        return s
    kind = s[len("torch.cuda."):]
    dt = get_accelerator().device_type
    return f"torch.{kind}" if dt == "cpu" else f"torch.{dt}.{kind}"


def tensor_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs: Any) -> Any:
    """Tensor.type (replacement): framework code compares against 'torch.cuda.*' strings; answer in CUDA spelling."""
    if dtype is None and not kwargs:
        s = _BASE_TYPE(self)
        return cuda_type_string(s, get_accelerator().device_type) if caller_is_framework(2) else s
    if isinstance(dtype, str) and dtype.startswith("torch.cuda.") and caller_is_framework(2):
        dtype = local_type_string(dtype)
    return _BASE_TYPE(self, dtype, non_blocking, **kwargs)


_NOT_CALLERS = ("torch", "portspeed", "wrapt", "importlib", "functools", "contextlib")


def _calling_module() -> str | None:
    """The first module up the stack that is neither torch nor portspeed (nor their plumbing)."""
    f = sys._getframe(2)
    while f is not None:
        name = f.f_globals.get("__name__") or ""
        if name.split(".", 1)[0] not in _NOT_CALLERS:
            return name
        f = f.f_back
    return None


def _untranslated_hint(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """torch.cuda.set_device / torch.cuda._lazy_init: when the call fails for a module portspeed does not
    translate, add a note naming the module and PORTSPEED_FRAMEWORK_MODULES (same exception, same type)."""
    try:
        return wrapped(*args, **kwargs)
    except (AssertionError, RuntimeError, AttributeError) as exc:
        who = _calling_module()
        if who and not is_framework_module(who) and not any(
                FRAMEWORK_ENV in n for n in getattr(exc, "__notes__", ())):
            exc.add_note(
                f"portspeed: this torch.cuda call came from module {who!r}, which portspeed does not translate "
                f"(adapter {get_accelerator().name!r}: only framework modules get torch.cuda answered by it). "
                f"If it is your own code written for CUDA, opt it in: {FRAMEWORK_ENV}={who} (the entry script "
                "is '__main__'; comma-separate several), see docs/megatron-core-loop.md")
        raise


_REASON_TO = "framework code moves tensors to 'cuda' devices; on another adapter they belong on its device"
_COMMON = dict(kind=WRAP, distribution="torch", versions=">=2.6", when=translated)
_COMMON_R = dict(_COMMON, kind=REPLACE)

PATCHES: list[Patch] = [
    Patch(name="torch.tensor_to", target="torch:Tensor.to", impl=tensor_to, reason=_REASON_TO, **_COMMON_R),
    Patch(name="torch.tensor_cuda", target="torch:Tensor.cuda", impl=_tensor_cuda,
          reason="framework code calls tensor.cuda(); on another adapter the tensor goes to its device",
          **_COMMON),
    Patch(name="torch.tensor_new_empty", target="torch:Tensor.new_empty", impl=_tensor_new,
          reason="Megatron's all-to-all-v (MoE token dispatch with expert parallelism) allocates with "
          "tensor.new_empty(device=torch.cuda.current_device()); on another adapter that index is its device",
          **_COMMON),
    Patch(name="torch.module_to", target="torch.nn:Module.to", impl=_to, reason=_REASON_TO, **_COMMON),
    Patch(name="torch.module_cuda", target="torch.nn:Module.cuda", impl=_module_cuda,
          reason="framework code calls model.cuda(); on another adapter parameters go to its device",
          **_COMMON),
    Patch(name="torch.tensor_type", target="torch:Tensor.type", impl=tensor_type,
          reason="Megatron's optimizers assert grad.type() == 'torch.cuda.FloatTensor'; answer in CUDA spelling",
          **_COMMON_R),
    Patch(name="torch.cuda_untranslated_hint", target="torch.cuda:_lazy_init", impl=_untranslated_hint,
          reason="a torch.cuda call from a module that is not translated fails with torch's own error; "
          "the error then names the module and PORTSPEED_FRAMEWORK_MODULES", **_COMMON),
    Patch(name="torch.cuda_set_device_untranslated_hint", target="torch.cuda:set_device", impl=_untranslated_hint,
          reason="torch.cuda.set_device from a module that is not translated fails without calling _lazy_init "
          "on a CPU build of torch; the error then names the module and PORTSPEED_FRAMEWORK_MODULES", **_COMMON),
]
