"""``TorchView``: ``torch`` as framework modules see it, and the translation of CUDA device arguments.

Contract
- ``names_cuda(value)`` / ``translate_device(value)``: whether a device argument names CUDA
  the way torch accepts one ("cuda", "cuda:1", ``torch.device("cuda")``, an int index), and
  the adapter's device for it; any other value is returned unchanged. The view's factories
  and the Tensor/Module patches (``portspeed.patches.torch_cuda``) use these two.
- ``TorchView`` is a module-like proxy of ``torch``: ``.cuda`` is the CudaView, the tensor
  factories (``FACTORIES``), ``autocast`` and ``Generator`` translate CUDA device arguments
  to the adapter's device (the two classes stay classes: ``served_class``, ``Generator``);
  everything else is the real torch object, copied into the view's namespace, so an
  attribute read costs what it costs on the real module.

Which modules see the view, and when, is ``portspeed.translation.importer``'s business;
nothing here installs anything.

Example::

    from portspeed.translation.torch_namespace import translate_device
    translate_device("cuda:0")        # device(type='cpu') on the CPU adapter
"""

from __future__ import annotations

import functools
import types
from typing import Any, Callable

import torch

from portspeed.accelerator import get_accelerator
from portspeed.translation.cuda_view import CudaView, _autocast
from portspeed.translation.served_class import served_class

__all__ = ["FACTORIES", "Generator", "TorchView", "names_cuda", "translate_device"]

_REAL_TORCH = torch
_DEVICE = torch.device


# ---------------------------------------------------------------------- device translation
def names_cuda(value: Any) -> bool:
    """Whether ``value`` names a CUDA device the way torch accepts one ("cuda", "cuda:1", device, int)."""
    t = type(value)
    if t is str:
        return value.startswith("cuda")
    if t is _DEVICE:
        return value.type == "cuda"
    return t is int


def translate_device(value: Any) -> Any:
    """The adapter's device for a CUDA device argument; any other value is returned unchanged."""
    t = type(value)
    if t is str:
        if not value.startswith("cuda"):
            return value
        index = _DEVICE(value).index
    elif t is _DEVICE:
        if value.type != "cuda":
            return value
        index = value.index
    elif t is int:
        index = value
    else:
        return value
    acc = get_accelerator()
    key = (id(acc), index)
    dev = _device_cache.get(key)
    if dev is None or dev[0] is not acc:
        dev = (acc, acc.device(index))
        if acc.device_type == "cpu" or index is not None:  # "cuda" alone follows the current device
            _device_cache[key] = dev
    return dev[1]


_device_cache: dict[tuple[int, Any], tuple[Any, torch.device]] = {}


# ---------------------------------------------------------------------- torch view
#: torch functions that take ``device=`` and so get a translating wrapper in the view.
FACTORIES = (
    "empty", "zeros", "ones", "full", "tensor", "as_tensor", "arange", "range", "rand", "randn", "randint",
    "randperm", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "linspace", "logspace", "eye", "empty_strided", "scalar_tensor", "tril_indices",
    "triu_indices", "normal", "frombuffer",
)


def _factory(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a torch factory so a CUDA ``device=`` lands on the adapter's device (and ``pin_memory=True``
    means nothing where the device is the host: it is dropped there)."""

    @functools.wraps(fn)
    def factory(*args: Any, **kwargs: Any) -> Any:
        d = kwargs.get("device")
        if d is not None:
            kwargs["device"] = translate_device(d)
        if kwargs.get("pin_memory") and get_accelerator().device_is_host:
            # pinned memory speeds copies to a device; where the device is the host there is none, and torch
            # raises without an accelerator ("no pinned memory allocator"; a CUDA build: "no NVIDIA driver")
            kwargs["pin_memory"] = False
        return fn(*args, **kwargs)

    factory.__portspeed_original__ = fn  # type: ignore[attr-defined]
    return factory


class _GeneratorType(type):
    """Metaclass of the view's ``Generator``: it *is* torch.Generator for isinstance, issubclass and class attributes.

    Megatron probes ``hasattr(torch.Generator, "graphsafe_set_state")`` and tests
    ``isinstance(state, torch.Generator)``; both must answer as for the real class.
    """

    def __instancecheck__(cls, obj: Any) -> bool:
        return type.__instancecheck__(cls, obj) or isinstance(obj, _REAL_TORCH.Generator)

    def __subclasscheck__(cls, sub: type) -> bool:
        return type.__subclasscheck__(cls, sub) or issubclass(sub, _REAL_TORCH.Generator)

    def __getattr__(cls, attr: str) -> Any:
        return getattr(_REAL_TORCH.Generator, attr)

    def __call__(cls, *args: Any, **kwargs: Any) -> torch.Generator:
        if args:
            args = (translate_device(args[0]), *args[1:])
        if "device" in kwargs:
            kwargs["device"] = translate_device(kwargs["device"])
        return _REAL_TORCH.Generator(*args, **kwargs)


class Generator(metaclass=_GeneratorType):
    """``torch.Generator`` for framework modules: a CUDA ``device`` (name, torch.device or index) means the adapter's.

    Megatron's text-generation controller makes its sampling generator with
    ``torch.Generator(device=torch.cuda.current_device())``; off CUDA that device must be
    the adapter's, and the generator the adapter's device generator type. Instances are
    real ``torch.Generator`` objects.
    """

    __portspeed_original__ = _REAL_TORCH.Generator


#: ``torch.autocast`` for framework modules: a class (annotations, isinstance) whose call maps a CUDA
#: device type onto the adapter's; instances are real ``torch.autocast`` objects.
Autocast = served_class("autocast", _autocast, module="torch", real=_REAL_TORCH.autocast)


class TorchView(types.ModuleType):
    """``torch`` as framework modules see it: the real namespace, with ``cuda`` and factories translated."""

    def __init__(self, cuda: CudaView) -> None:
        super().__init__("torch", _REAL_TORCH.__doc__)
        self.__dict__.update(_REAL_TORCH.__dict__)
        self.__dict__["__name__"] = "torch"
        self.__dict__["__portspeed_view__"] = True
        for name in FACTORIES:
            fn = getattr(_REAL_TORCH, name, None)
            if fn is not None:
                self.__dict__[name] = _factory(fn)
        self.__dict__["autocast"] = Autocast
        self.__dict__["Generator"] = Generator
        self.__dict__["cuda"] = cuda

    def __getattr__(self, attr: str) -> Any:
        # names torch creates lazily (submodules imported later, deprecated aliases)
        value = getattr(_REAL_TORCH, attr)
        if attr != "cuda":
            self.__dict__[attr] = value
        return value

    def __repr__(self) -> str:
        return "<portspeed TorchView of torch>"
