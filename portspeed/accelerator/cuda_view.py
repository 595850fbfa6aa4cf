"""``CudaView``: the torch.cuda API as framework modules see it, answered by the active adapter.

Contract: each name Megatron / DeepSpeed use maps onto ``portspeed.accelerator.get_accelerator()``
with torch.cuda's signatures and return types (``current_device()`` is an int,
``default_generators[i]`` a generator, ``_lazy_call`` runs at once); CUDA-only features
(graphs, memory pools, external streams) and any name not mapped raise
``UnsupportedCudaCallError`` naming the call, the caller's file:line, the adapter and what
to do. ``portspeed.accelerator.translation`` scopes this view onto framework modules; nothing else
sees it.

Example::

    from portspeed.accelerator.translation import cuda_view
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
from portspeed.errors import UnsupportedCudaCallError

__all__ = ["CudaView"]

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
            return [get_accelerator().default_generator(i) for i in range(len(self))[index]]  # type: ignore[return-value]
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

    def __init__(self, name: str, **attrs: Any) -> None:
        super().__init__(name)
        self.__dict__.update(attrs)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        short = self.__name__.removeprefix("torch.cuda.")
        raise _unsupported(f"{short}.{attr}", _caller())


def _unavailable_type(name: str, hint: str) -> type:
    """A stand-in class for a CUDA-only type: usable in annotations, raises when constructed."""

    def __new__(cls: type, *args: Any, **kwargs: Any) -> Any:
        raise _unsupported(name, _caller(), hint)

    return type(name, (), {"__new__": __new__, "__module__": "torch.cuda",
                           "__doc__": f"torch.cuda.{name} has no translation off CUDA ({hint})"})


class CudaView(types.ModuleType):
    """torch.cuda as framework modules see it: each call answered by the active adapter.

    Only names listed here exist; any other raises UnsupportedCudaCallError (an
    AttributeError, so ``hasattr`` probes answer False).
    """

    #: torch.cuda names forwarded unchanged: type objects and exceptions that are device-neutral.
    _FORWARD = ("FloatTensor", "HalfTensor", "BFloat16Tensor", "DoubleTensor", "LongTensor", "IntTensor",
                "ByteTensor", "BoolTensor", "CharTensor", "ShortTensor", "OutOfMemoryError")
    #: CUDA-only features with no translation; the error says so at the first touch.
    _NO_TRANSLATION = {
        "CUDAGraph": "CUDA graphs need CUDA; turn off cuda-graph options",
        "graph": "CUDA graphs need CUDA; turn off cuda-graph options",
        "graphs": "CUDA graphs need CUDA; turn off cuda-graph options",
        "graph_pool_handle": "CUDA graphs need CUDA; turn off cuda-graph options",
        "make_graphed_callables": "CUDA graphs need CUDA; turn off cuda-graph options",
        "MemPool": "CUDA memory pools (nccl_ub, UVM) need CUDA",
        "use_mem_pool": "CUDA memory pools (nccl_ub, UVM) need CUDA",
        "ExternalStream": "external CUDA streams need CUDA",
        "CUDAPluggableAllocator": "pluggable CUDA allocators need CUDA",
        # not a CUDA-only feature: the name does not exist in torch.cuda on any build, so the
        # view does not invent it (a hasattr probe must answer as it does on CUDA)
        "Generator": "torch.cuda has no Generator on any torch build, CUDA included; "
                     "torch.Generator(device='cuda') is the CUDA generator and is translated",
    }

    def __init__(self) -> None:
        super().__init__("torch.cuda", "torch.cuda translated onto the active portspeed adapter")
        for name in self._FORWARD:
            if hasattr(_REAL_CUDA, name):
                self.__dict__[name] = getattr(_REAL_CUDA, name)
        self.default_generators = _Generators()
        self.device = _DeviceContext
        self._initialized = True
        self.nvtx = _Namespace("torch.cuda.nvtx", range_push=self._range_push, range_pop=self._range_pop,
                               range=self._range, mark=lambda msg: None)
        amp = _Namespace(
            "torch.cuda.amp",
            autocast=_cuda_autocast,
            custom_fwd=self._custom_fwd,
            custom_bwd=self._custom_bwd,
            GradScaler=lambda *a, **k: _REAL_TORCH.amp.GradScaler(get_accelerator().device_type, *a, **k),
        )
        self.amp = amp
        self.random = _Namespace(
            "torch.cuda.random", get_rng_state=self.get_rng_state, set_rng_state=self.set_rng_state,
            manual_seed=self.manual_seed, manual_seed_all=self.manual_seed_all,
            initial_seed=self.initial_seed, seed=self.seed, get_rng_state_all=self.get_rng_state_all,
            set_rng_state_all=self.set_rng_state_all)
        memory_names = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                        "reset_peak_memory_stats", "memory_stats", "empty_cache", "mem_get_info",
                        "reset_max_memory_allocated")
        self.memory = _Namespace("torch.cuda.memory", **{n: getattr(self, n) for n in memory_names})

    #: CUDA-only classes that framework code names in annotations at import time (Megatron-LM's
    #: megatron.core.resharding, imported by megatron.training): naming them works, constructing
    #: one raises (see _unavailable_type).
    _TYPES_NAMED_AT_IMPORT = ("ExternalStream",)

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        if attr in self._TYPES_NAMED_AT_IMPORT:
            cls = _unavailable_type(attr, self._NO_TRANSLATION.get(attr, ""))
            self.__dict__[attr] = cls
            return cls
        raise _unsupported(attr, _caller(), self._NO_TRANSLATION.get(attr, ""))

    def __repr__(self) -> str:
        return f"<portspeed CudaView of torch.cuda on {get_accelerator().name!r}>"

    # -- availability and devices ------------------------------------------------
    @staticmethod
    def is_available() -> bool:
        """True: an accelerator (the adapter's) is there for the framework."""
        return bool(get_accelerator().is_available())

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _lazy_init() -> None:
        return None

    @staticmethod
    def _lazy_call(callable: Callable[[], Any], **kwargs: Any) -> None:
        """Run now: a CPU build's torch.cuda._lazy_call queues the callback forever (a silent no-op)."""
        callable()

    @staticmethod
    def init() -> None:
        return None

    @staticmethod
    def device_count() -> int:
        return int(get_accelerator().device_count())

    @staticmethod
    def current_device() -> int:
        return int(get_accelerator().current_device())

    @staticmethod
    def set_device(device: Any) -> None:
        idx = _device_index(device)
        if idx is not None:
            get_accelerator().set_device(idx)

    @staticmethod
    def synchronize(device: Any = None) -> None:
        get_accelerator().synchronize(_device_index(device))

    @staticmethod
    def get_device_properties(device: Any = None) -> _DeviceProperties:
        idx = _device_index(device)
        return _DeviceProperties(get_accelerator().current_device() if idx is None else idx)

    @staticmethod
    def get_device_capability(device: Any = None) -> tuple[int, int]:
        """(0, 0): no CUDA compute capability, so capability-gated CUDA paths stay off."""
        return (0, 0)

    @staticmethod
    def get_device_name(device: Any = None) -> str:
        idx = _device_index(device)
        return _DeviceProperties(get_accelerator().current_device() if idx is None else idx).name

    @staticmethod
    def is_bf16_supported(including_emulation: bool = True) -> bool:
        return bool(get_accelerator().is_bf16_supported())

    @staticmethod
    def is_current_stream_capturing() -> bool:
        """False: nothing is ever being captured into a CUDA graph here."""
        return False

    # -- random number generation -------------------------------------------------
    @staticmethod
    def get_rng_state(device: Any = "cuda") -> torch.Tensor:
        return get_accelerator().get_rng_state(_device_index(device))

    @staticmethod
    def set_rng_state(new_state: torch.Tensor, device: Any = "cuda") -> None:
        get_accelerator().set_rng_state(new_state, _device_index(device))

    @staticmethod
    def get_rng_state_all() -> list[torch.Tensor]:
        acc = get_accelerator()
        return [acc.get_rng_state(i) for i in range(max(1, acc.device_count()))]

    @staticmethod
    def set_rng_state_all(new_states: Iterable[torch.Tensor]) -> None:
        acc = get_accelerator()
        for i, s in enumerate(new_states):
            acc.set_rng_state(s, i)

    @staticmethod
    def manual_seed(seed: int) -> None:
        get_accelerator().manual_seed(int(seed))

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        get_accelerator().manual_seed_all(int(seed))

    @staticmethod
    def seed() -> None:
        get_accelerator().default_generator().seed()

    @staticmethod
    def initial_seed() -> int:
        return int(get_accelerator().initial_seed())

    # -- streams and events ---------------------------------------------------------
    @staticmethod
    def Stream(*args: Any, **kwargs: Any) -> Any:  # noqa: N802 - mirrors torch.cuda
        return get_accelerator().Stream(*args, **kwargs)

    @staticmethod
    def Event(*args: Any, **kwargs: Any) -> Any:  # noqa: N802
        return get_accelerator().Event(*args, **kwargs)

    @staticmethod
    def current_stream(device: Any = None) -> Any:
        return get_accelerator().current_stream(_device_index(device))

    @staticmethod
    def default_stream(device: Any = None) -> Any:
        return get_accelerator().default_stream(_device_index(device))

    @staticmethod
    def stream(stream: Any) -> Any:
        return get_accelerator().stream(stream)

    @staticmethod
    def set_stream(stream: Any) -> None:
        """Streams of a device without streams are all the same ordered stream: nothing to switch."""
        acc = get_accelerator()
        fn = getattr(acc.module, "set_stream", None) if acc.device_type not in ("cpu",) else None
        if fn is not None:
            fn(stream)

    # -- memory ------------------------------------------------------------------------
    @staticmethod
    def memory_allocated(device: Any = None) -> int:
        return get_accelerator().memory_allocated(_device_index(device))

    @staticmethod
    def max_memory_allocated(device: Any = None) -> int:
        return get_accelerator().max_memory_allocated(_device_index(device))

    @staticmethod
    def memory_reserved(device: Any = None) -> int:
        return get_accelerator().memory_reserved(_device_index(device))

    @staticmethod
    def max_memory_reserved(device: Any = None) -> int:
        return get_accelerator().max_memory_reserved(_device_index(device))

    @staticmethod
    def reset_peak_memory_stats(device: Any = None) -> None:
        get_accelerator().reset_peak_memory_stats(_device_index(device))

    reset_max_memory_allocated = reset_peak_memory_stats

    @staticmethod
    def memory_stats(device: Any = None) -> dict[str, Any]:
        return get_accelerator().memory_stats(_device_index(device))

    @staticmethod
    def empty_cache() -> None:
        get_accelerator().empty_cache()

    @staticmethod
    def mem_get_info(device: Any = None) -> tuple[int, int]:
        acc = get_accelerator()
        idx = _device_index(device)
        total = acc.total_memory(idx)
        return (max(0, total - acc.memory_allocated(idx)), total)

    # -- profiling ranges and amp ----------------------------------------------------------
    @staticmethod
    def _range_push(msg: str) -> None:
        get_accelerator().range_push(msg)

    @staticmethod
    def _range_pop() -> None:
        get_accelerator().range_pop()

    @staticmethod
    @contextlib.contextmanager
    def _range(msg: str, *args: Any, **kwargs: Any) -> Iterator[None]:
        acc = get_accelerator()
        acc.range_push(msg.format(*args, **kwargs) if (args or kwargs) else msg)
        try:
            yield
        finally:
            acc.range_pop()

    @staticmethod
    def _custom_fwd(fwd: Any = None, **kwargs: Any) -> Any:
        kwargs.setdefault("device_type", get_accelerator().device_type)
        return _REAL_TORCH.amp.custom_fwd(fwd, **kwargs) if fwd is not None else functools.partial(
            _REAL_TORCH.amp.custom_fwd, **kwargs)

    @staticmethod
    def _custom_bwd(bwd: Any = None, **kwargs: Any) -> Any:
        kwargs.setdefault("device_type", get_accelerator().device_type)
        return _REAL_TORCH.amp.custom_bwd(bwd, **kwargs) if bwd is not None else functools.partial(
            _REAL_TORCH.amp.custom_bwd, **kwargs)

    autocast = staticmethod(_cuda_autocast)
