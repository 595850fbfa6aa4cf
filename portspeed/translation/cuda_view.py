"""``CudaView``: the torch.cuda API as framework modules see it, answered by the active adapter.

The view is a table, ``CUDA_API`` (torch.cuda name -> rule, in the rule kinds of
``portspeed.translation.cuda_rules``), built into plain functions and objects once, when
this module is imported; this module holds the table and the few hand-written pieces it
uses (device context, generators, properties, ranges, amp).

Contract: each name Megatron / DeepSpeed use maps onto ``portspeed.accelerator.get_accelerator()``
with torch.cuda's signatures and return types (``current_device()`` is an int,
``default_generators[i]`` a generator, ``_lazy_call`` runs at once); CUDA-only features
(graphs, memory pools, external streams) and any name not mapped raise
``UnsupportedCudaCallError`` naming the call, the caller's file:line, the adapter and what
to do. ``portspeed.translation.importer`` scopes this view onto framework modules; nothing else
sees it.

Example::

    from portspeed.translation.importer import cuda_view
    cuda_view().current_device()      # 0 on the CPU adapter
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import types
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

from portspeed.accelerator import get_accelerator
from portspeed.translation.cuda_rules import (BOOL, DISCARD, INT, Alias, Delegate, Forward, NamedOnly, Namespace,
                                              Returns, Signature, Unsupported, Use, build)
from portspeed.translation.served_class import served_class
from portspeed.errors import UnsupportedCudaCallError

__all__ = ["CUDA_API", "CudaView"]

_REAL_TORCH = torch
_REAL_CUDA = torch.cuda
_DEVICE = torch.device

def _device_index(device: Any) -> int | None:
    """The index a torch.cuda-style ``device`` argument names (None: the current device)."""
    if device is None:
        return None
    if isinstance(device, int):
        return None if device < 0 else device
    if isinstance(device, str):
        device = _DEVICE(device)
    if isinstance(device, _DEVICE):
        return device.index
    raise TypeError(f"torch.cuda device argument must be an int, a str or a torch.device, not {type(device).__name__}")


def _caller(depth: int = 2) -> str:
    """file:line of the frame ``depth`` levels up (for error messages)."""
    try:
        f = sys._getframe(depth)
    except ValueError:  # pragma: no cover - shallow stack
        return "<unknown>"
    return f"{f.f_code.co_filename}:{f.f_lineno}"


def _unsupported(call: str, where: str, hint: str = "") -> UnsupportedCudaCallError:
    acc = get_accelerator()
    return UnsupportedCudaCallError(
        f"torch.cuda.{call} called from {where} has no translation for the {acc.name!r} adapter"
        + (f" ({hint})" if hint else "")
        + "; turn off the framework option that needs it, set PORTSPEED_DISABLE for the patch involved, "
        "or report an issue naming this call"
    )


# ---------------------------------------------------------------------- torch.cuda view pieces
class _Generators(Sequence):
    """``torch.cuda.default_generators`` answered by the adapter (index -> generator)."""

    def __getitem__(self, index: Any) -> torch.Generator:  # type: ignore[override]
        if isinstance(index, slice):
            acc = get_accelerator()
            return [acc.default_generator(i) for i in range(len(self))[index]]  # type: ignore[return-value]
        return get_accelerator().default_generator(int(index))

    def __len__(self) -> int:
        return max(1, get_accelerator().device_count())


class _DeviceProperties:
    """What ``get_device_properties`` answers for a non-CUDA device: honest, CUDA-shaped fields."""

    def __init__(self, index: int) -> None:
        acc = get_accelerator()
        self.name = f"portspeed {acc.name} device {index}"
        self.total_memory = acc.total_memory(index)
        self.major = 0
        self.minor = 0
        self.multi_processor_count = os.cpu_count() or 1
        self.is_integrated = False
        self.is_multi_gpu_board = False

    def __repr__(self) -> str:
        return f"_DeviceProperties(name={self.name!r}, total_memory={self.total_memory}, major=0, minor=0)"


class _DeviceContext:
    """``torch.cuda.device(i)``: make ``i`` current for a block, restore after."""

    def __init__(self, device: Any) -> None:
        self.index = _device_index(device)
        self.prev: int | None = None

    def __enter__(self) -> "_DeviceContext":
        acc = get_accelerator()
        self.prev = acc.current_device()
        if self.index is not None:
            acc.set_device(self.index)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.prev is not None and self.index is not None:
            get_accelerator().set_device(self.prev)


def _autocast(device_type: Any = "cuda", *args: Any, **kwargs: Any) -> Any:
    """torch.autocast with a CUDA device type mapped to the adapter's device type."""
    if device_type == "cuda":
        device_type = get_accelerator().device_type
    return _REAL_TORCH.autocast(device_type, *args, **kwargs)


def _cuda_autocast(*args: Any, **kwargs: Any) -> Any:
    """torch.cuda.amp.autocast(...) / torch.cuda.autocast(...) on the adapter's device."""
    return _REAL_TORCH.autocast(get_accelerator().device_type, *args, **kwargs)


class _Namespace(types.ModuleType):
    """A small module-like namespace (nvtx, amp, random, memory) whose unknown names raise clearly."""

    def __init__(self, name: str, attrs: dict[str, Any], hints: dict[str, str]) -> None:
        super().__init__(name)
        self.__dict__.update(attrs)
        self._hints = hints

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        short = self.__name__.removeprefix("torch.cuda.")
        raise _unsupported(f"{short}.{attr}", _caller(), self._hints.get(attr, ""))


def _unavailable_type(name: str, hint: str) -> type:
    """A stand-in class for a CUDA-only type: usable in annotations, raises when constructed."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported(name, _caller(), hint)

    return type(name, (), {"__new__": __new__, "__module__": "torch.cuda",
                           "__doc__": f"torch.cuda.{name} has no translation off CUDA ({hint})"})


# ---------------------------------------------------------------------- hand-written pieces of the table
def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
    """Run now: a CPU build's torch.cuda._lazy_call queues the callback forever (a silent no-op)."""
    callable()


def _set_device(device: Any) -> None:
    """torch.cuda.set_device: a negative index or None leaves the current device."""
    idx = _device_index(device)
    if idx is not None:
        get_accelerator().set_device(idx)


def _get_device_properties(device: Any = None) -> _DeviceProperties:
    idx = _device_index(device)
    return _DeviceProperties(get_accelerator().current_device() if idx is None else idx)


def _get_device_name(device: Any = None) -> str:
    idx = _device_index(device)
    return _DeviceProperties(get_accelerator().current_device() if idx is None else idx).name


def _get_rng_state_all() -> list[torch.Tensor]:
    acc = get_accelerator()
    return [acc.get_rng_state(i) for i in range(max(1, acc.device_count()))]


def _set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
    acc = get_accelerator()
    for i, s in enumerate(new_states):
        acc.set_rng_state(s, i)


def _seed() -> None:
    get_accelerator().default_generator().seed()


def _set_stream(stream: Any) -> None:
    """Streams of a device without streams are all the same ordered stream: nothing to switch."""
    acc = get_accelerator()
    fn = getattr(acc.module, "set_stream", None) if acc.device_type not in ("cpu",) else None
    if fn is not None:
        fn(stream)


def _mem_get_info(device: Any = None) -> tuple[int, int]:
    acc = get_accelerator()
    idx = _device_index(device)
    total = acc.total_memory(idx)
    return (max(0, total - acc.memory_allocated(idx)), total)


@contextlib.contextmanager
def _range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
    acc = get_accelerator()
    acc.range_push(msg.format(*args, **kwargs) if (args or kwargs) else msg)
    try:
        yield
    finally:
        acc.range_pop()


def _custom_fwd(fwd: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("device_type", get_accelerator().device_type)
    return _REAL_TORCH.amp.custom_fwd(fwd, **kwargs) if fwd is not None else functools.partial(
        _REAL_TORCH.amp.custom_fwd, **kwargs)


def _custom_bwd(bwd: Any = None, **kwargs: Any) -> Any:
    kwargs.setdefault("device_type", get_accelerator().device_type)
    return _REAL_TORCH.amp.custom_bwd(bwd, **kwargs) if bwd is not None else functools.partial(
        _REAL_TORCH.amp.custom_bwd, **kwargs)


def _grad_scaler(*args: Any, **kwargs: Any) -> Any:
    return _REAL_TORCH.amp.GradScaler(get_accelerator().device_type, *args, **kwargs)


# torch classes served as classes whose call makes the adapter's object (``served_class``); ``device``,
# the named-only types and the Forward types are classes already (tests/test_view_classes.py)
_REAL_AMP = _REAL_CUDA.amp
_Stream = served_class("Stream", lambda *a, **k: get_accelerator().Stream(*a, **k),
                       real=getattr(_REAL_CUDA, "Stream", None), also=(getattr(_REAL_TORCH, "Stream", None),),
                       probe=lambda: type(get_accelerator().current_stream()))
_Event = served_class("Event", lambda *a, **k: get_accelerator().Event(*a, **k),
                      real=getattr(_REAL_CUDA, "Event", None), also=(getattr(_REAL_TORCH, "Event", None),))
_CudaAutocast = served_class("autocast", _cuda_autocast, module="torch.cuda.amp",
                             real=getattr(_REAL_AMP, "autocast", None), also=(_REAL_TORCH.amp.autocast,))
_GradScaler = served_class("GradScaler", _grad_scaler, module="torch.cuda.amp",
                           real=getattr(_REAL_AMP, "GradScaler", None), also=(_REAL_TORCH.amp.GradScaler,))


# ---------------------------------------------------------------------- the table
NOTHING = Signature()
DEVICE = Signature("device=None", "_device_index(device)")
CUDA_DEVICE = Signature("device='cuda'", "_device_index(device)")
STATE_ON_CUDA_DEVICE = Signature("new_state, device='cuda'", "new_state, _device_index(device)")
SEED = Signature("seed", "int(seed)")
STREAM = Signature("stream", "stream")
MESSAGE = Signature("msg", "msg")

_GRAPHS = "CUDA graphs need CUDA; turn off cuda-graph options"
_POOLS = "CUDA memory pools (nccl_ub, UVM) need CUDA"

#: torch.cuda name -> rule: everything framework modules see of torch.cuda. A name not listed
#: raises UnsupportedCudaCallError (an AttributeError, so ``hasattr`` probes answer False).
CUDA_API: dict[str, Any] = {
    # device-neutral types and exceptions: torch.cuda's own
    **{name: Forward() for name in ("FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor", "LongTensor",
                                    "IntTensor", "ByteTensor", "BoolTensor", "CharTensor", "ShortTensor",
                                    "OutOfMemoryError")},
    # availability and devices
    "is_available": Delegate("is_available", result=BOOL),
    "is_initialized": Returns(True),
    "_initialized": Use(True),
    "_lazy_init": Returns(None),
    "_lazy_call": Use(_lazy_call),
    "init": Returns(None),
    "device_count": Delegate("device_count", result=INT),
    "current_device": Delegate("current_device", result=INT),
    "set_device": Use(_set_device),
    "device": Use(_DeviceContext),
    "synchronize": Delegate("synchronize", DEVICE, DISCARD),
    "get_device_properties": Use(_get_device_properties),
    # (0, 0): no CUDA compute capability, so capability-gated CUDA paths stay off
    "get_device_capability": Returns((0, 0), "device=None"),
    "get_device_name": Use(_get_device_name),
    "is_bf16_supported": Delegate("is_bf16_supported", Signature("including_emulation=True"), BOOL),
    # nothing is ever being captured into a CUDA graph here
    "is_current_stream_capturing": Returns(False),
    # random number generation
    "default_generators": Use(_Generators()),
    "get_rng_state": Delegate("get_rng_state", CUDA_DEVICE),
    "set_rng_state": Delegate("set_rng_state", STATE_ON_CUDA_DEVICE, DISCARD),
    "get_rng_state_all": Use(_get_rng_state_all),
    "set_rng_state_all": Use(_set_rng_state_all),
    "manual_seed": Delegate("manual_seed", SEED, DISCARD),
    "manual_seed_all": Delegate("manual_seed_all", SEED, DISCARD),
    "seed": Use(_seed),
    "initial_seed": Delegate("initial_seed", result=INT),
    # streams and events
    "Stream": Use(_Stream),
    "Event": Use(_Event),
    "current_stream": Delegate("current_stream", DEVICE),
    "default_stream": Delegate("default_stream", DEVICE),
    "stream": Delegate("stream", STREAM),
    "set_stream": Use(_set_stream),
    # memory
    "memory_allocated": Delegate("memory_allocated", DEVICE),
    "max_memory_allocated": Delegate("max_memory_allocated", DEVICE),
    "memory_reserved": Delegate("memory_reserved", DEVICE),
    "max_memory_reserved": Delegate("max_memory_reserved", DEVICE),
    "reset_peak_memory_stats": Delegate("reset_peak_memory_stats", DEVICE, DISCARD),
    "reset_max_memory_allocated": Alias("reset_peak_memory_stats"),
    "memory_stats": Delegate("memory_stats", DEVICE),
    "empty_cache": Delegate("empty_cache", result=DISCARD),
    "mem_get_info": Use(_mem_get_info),
    # autocast on the adapter's device type
    "autocast": Use(_CudaAutocast),
    # sub-namespaces
    "nvtx": Namespace({"range_push": Delegate("range_push", MESSAGE, DISCARD),
                       "range_pop": Delegate("range_pop", result=DISCARD),
                       "range": Use(_range), "mark": Returns(None, "msg")}),
    "amp": Namespace({"autocast": Use(_CudaAutocast), "custom_fwd": Use(_custom_fwd),
                      "custom_bwd": Use(_custom_bwd), "GradScaler": Use(_GradScaler)}),
    "random": Namespace({name: Alias(name) for name in (
        "get_rng_state", "set_rng_state", "manual_seed", "manual_seed_all", "initial_seed", "seed",
        "get_rng_state_all", "set_rng_state_all")}),
    "memory": Namespace({name: Alias(name) for name in (
        "memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
        "reset_peak_memory_stats", "memory_stats", "empty_cache", "mem_get_info", "reset_max_memory_allocated")}),
    # CUDA-only features: no translation, the error says so at the first touch
    "CUDAGraph": Unsupported(_GRAPHS),
    "graph": Unsupported(_GRAPHS),
    "graphs": Unsupported(_GRAPHS),
    "graph_pool_handle": Unsupported(_GRAPHS),
    "make_graphed_callables": Unsupported(_GRAPHS),
    # named in a class-level annotation (``torch.cuda.MemPool | None``) by Megatron-LM main's
    # megatron_fsdp/experimental/parameter_group.py: naming it works, constructing one raises
    "MemPool": NamedOnly(_POOLS),
    "use_mem_pool": Unsupported(_POOLS),
    # named in annotations at import time (Megatron-LM's megatron.core.resharding, imported by
    # megatron.training): naming it works, constructing one raises
    "ExternalStream": NamedOnly("external CUDA streams need CUDA"),
    "CUDAPluggableAllocator": Unsupported("pluggable CUDA allocators need CUDA"),
    # not a CUDA-only feature: the name does not exist in torch.cuda on any build, so the view
    # does not invent it (a hasattr probe must answer as it does on CUDA)
    "Generator": Unsupported("torch.cuda has no Generator on any torch build, CUDA included; "
                             "torch.Generator(device='cuda') is the CUDA generator and is translated"),
}

_ATTRIBUTES, _NO_TRANSLATION, _NAMED_ONLY = build(CUDA_API, globals(), _REAL_CUDA, _Namespace)


class CudaView(types.ModuleType):
    """torch.cuda as framework modules see it: each call answered by the active adapter.

    Only the names of ``CUDA_API`` exist; any other raises UnsupportedCudaCallError (an
    AttributeError, so ``hasattr`` probes answer False). The table's functions are the
    class's static methods (built once at import); its objects (namespaces, the device
    context, the generators) are set on each view.
    """

    #: CUDA-only features with no translation (from CUDA_API): name -> what the error says.
    _NO_TRANSLATION = _NO_TRANSLATION

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda translated onto the active portspeed adapter")
        for name, value in _ATTRIBUTES.items():
            if not isinstance(vars(CudaView).get(name), staticmethod):
                self.__dict__[name] = value

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in _NAMED_ONLY:
            cls = _unavailable_type(attr, _NAMED_ONLY[attr])
            self.__dict__[attr] = cls
            return cls
        raise _unsupported(attr, _caller(), _NO_TRANSLATION.get(attr, ""))

    def __repr__(self) -> str:
        return f"<portspeed CudaView of torch.cuda on {get_accelerator().name!r}>"


for _name, _value in _ATTRIBUTES.items():
    if isinstance(_value, types.FunctionType):
        setattr(CudaView, _name, staticmethod(_value))
del _name, _value
