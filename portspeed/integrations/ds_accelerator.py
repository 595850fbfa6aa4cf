"""DeepSpeed's accelerator interface, answered by the active portspeed adapter.

DeepSpeed asks one object, ``deepspeed.accelerator.get_accelerator()``, for every device
question (which device, which collective backend, streams, RNG, memory). DeepSpeed lets a
program inject that object with ``set_accelerator``; portspeed injects one built here, so
DeepSpeed's own code paths run unchanged while the answers come from
``portspeed.get_accelerator()``.

Contract
- ``build_ds_accelerator(adapter)`` returns a ``DeepSpeedAccelerator`` instance whose
  device, RNG, stream, event, memory, dtype and backend answers delegate to ``adapter``.
- On a cpu-like adapter (``device_type == "cpu"``) the object subclasses DeepSpeed's
  ``CPU_Accelerator``, so DeepSpeed keeps its CPU code paths (synchronized device, CPU op
  builders, host pinning rules), with three of its answers corrected: ``device()`` is a
  ``torch.device`` (not None), ``current_device()`` is an int (not the LOCAL_RANK
  string), ``is_fp16_supported()`` is a bool (not None). DeepSpeed's own CPU comm kernels
  (shared-memory and oneCCL op builders) are not offered: their collectives would bypass
  the process group, and so the adapter's backend; DeepSpeed then uses torch.distributed.
- On any other adapter the object subclasses ``DeepSpeedAccelerator`` directly. It offers
  DeepSpeed's host-side op builders (``HOST_OP_BUILDERS``: CPU Adam/Adagrad/Lion, async
  I/O, pinned host memory; offload is host work on every accelerator), the same classes
  DeepSpeed's CPU accelerator offers.
- On both, op builders come first from the adapter's own kernels (``Accelerator.deepspeed_ops()``,
  the vendor slot), then from portspeed's torch implementations (``QuantizerBuilder``: ZeRO++);
  any other device kernel (FusedAdam, transformer kernels...) is refused: ``create_op_builder``
  returns None, and ``get_op_builder`` a stand-in class whose ``load()`` names the fix
  (``portspeed.integrations.ds_op_builders``).
- ``device_count()`` is what DeepSpeed splits nodes by (qgZ's all-to-all groups, its node count):
  the ranks the launcher put on this node (``ds_nodes.node_size``), else the adapter's devices (CPU:
  DeepSpeed's NUMA count), so DeepSpeed sees the topology that was launched.

Limits: importing this module imports DeepSpeed; ``portspeed.deepspeed_adaptor`` imports
it only from a post-import hook, once DeepSpeed is being imported anyway.

Example::

    import deepspeed
    from portspeed import get_accelerator
    from portspeed.integrations.ds_accelerator import build_ds_accelerator
    deepspeed.accelerator.set_accelerator(build_ds_accelerator(get_accelerator()))
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable

import torch
from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from portspeed.accelerator import Accelerator
from portspeed.integrations.ds_nodes import node_size
from portspeed.integrations.ds_op_builders import (COMM_OP_BUILDERS, HOST_OP_BUILDERS, host_builder, served_builder,
                                                   unavailable_builder)

__all__ = ["AdapterBacked", "HOST_OP_BUILDERS", "PortspeedCpuAccelerator", "PortspeedAccelerator",
           "build_ds_accelerator"]


class AdapterBacked:
    """The part of DeepSpeed's accelerator interface that a portspeed adapter answers."""

    _adapter: Accelerator

    def _bind(self, adapter: Accelerator) -> None:
        self._adapter = adapter
        self._name = adapter.device_type
        self._communication_backend_name = adapter.communication_backend

    @property
    def adapter(self) -> Accelerator:
        """The portspeed adapter this object delegates to."""
        return self._adapter

    # -- devices -------------------------------------------------------------------
    def device_name(self, device_index: int | None = None) -> str:
        dt = self._adapter.device_type
        if device_index is None or dt == "cpu":
            return dt
        return f"{dt}:{int(device_index)}"

    def device(self, device_index: int | None = None) -> torch.device:
        return self._adapter.device(device_index)

    def set_device(self, device_index: Any) -> None:
        self._adapter.set_device(device_index)

    def current_device(self) -> int:
        return int(self._adapter.current_device())

    def current_device_name(self) -> str:
        return self.device_name(self.current_device())

    def synchronize(self, device_index: int | None = None) -> None:
        self._adapter.synchronize(device_index)

    def is_available(self) -> bool:
        return bool(self._adapter.is_available())

    # -- random number generation -----------------------------------------------------
    def random(self) -> Any:
        return torch.random

    def set_rng_state(self, new_state: torch.Tensor, device_index: int | None = None) -> None:
        self._adapter.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: int | None = None) -> torch.Tensor:
        return self._adapter.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        self._adapter.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        self._adapter.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return self._adapter.initial_seed()

    def default_generator(self, device_index: int | None = None) -> torch.Generator:
        return self._adapter.default_generator(device_index)

    # -- streams and events ---------------------------------------------------------------
    @property
    def Stream(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        return self._adapter.Stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager:
        return self._adapter.stream(stream)

    def current_stream(self, device_index: int | None = None) -> Any:
        return self._adapter.current_stream(device_index)

    def default_stream(self, device_index: int | None = None) -> Any:
        return self._adapter.default_stream(device_index)

    @property
    def Event(self) -> Callable[..., Any]:  # noqa: N802 - DeepSpeed's name
        return self._adapter.Event

    # -- memory ---------------------------------------------------------------------------
    def empty_cache(self) -> None:
        self._adapter.empty_cache()

    def memory_allocated(self, device_index: int | None = None) -> int:
        return self._adapter.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: int | None = None) -> int:
        return self._adapter.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: int | None = None) -> None:
        self._adapter.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: int | None = None) -> int:
        return self._adapter.memory_reserved(device_index)

    def max_memory_cached(self, device_index: int | None = None) -> int:
        return self._adapter.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: int | None = None) -> None:
        self._adapter.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: int | None = None) -> dict[str, Any]:
        return self._adapter.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: int | None = None) -> None:
        self._adapter.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: int | None = None) -> int:
        return self._adapter.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: int | None = None) -> int:
        return self._adapter.max_memory_reserved(device_index)

    def total_memory(self, device_index: int | None = None) -> int:
        return self._adapter.total_memory(device_index)

    # -- dtypes ---------------------------------------------------------------------------
    def is_bf16_supported(self) -> bool:
        return bool(self._adapter.is_bf16_supported())

    def is_fp16_supported(self) -> bool:
        return bool(self._adapter.is_fp16_supported())

    def supported_dtypes(self) -> list[torch.dtype]:
        return list(self._adapter.supported_dtypes())

    # -- misc -----------------------------------------------------------------------------
    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        self._adapter.range_push(msg)

    def range_pop(self, domain: Any = None) -> None:
        self._adapter.range_pop()

    def communication_backend_name(self) -> str:
        return self._adapter.communication_backend

    def __repr__(self) -> str:
        return f"<{type(self).__name__} backed by {self._adapter!r}>"


class PortspeedCpuAccelerator(AdapterBacked, CPU_Accelerator):
    """DeepSpeed's CPU accelerator with the answers of a cpu-like portspeed adapter.

    ``device_count`` keeps DeepSpeed's CPU meaning (ranks per node: LOCAL_SIZE, else NUMA
    nodes), since DeepSpeed uses it to split nodes, not to count chips; torchrun's
    LOCAL_WORLD_SIZE is read too.
    """

    def __init__(self, adapter: Accelerator) -> None:
        CPU_Accelerator.__init__(self)
        self._bind(adapter)

    def get_op_builder(self, class_name: str) -> Any:
        # DeepSpeed's CPU comm kernels (shared memory, oneCCL) move data outside the process
        # group; portspeed keeps every collective on the adapter's routed backend.
        if class_name in COMM_OP_BUILDERS:
            return None
        served = served_builder(class_name, self._adapter)
        if served is not None:
            return served
        builder = CPU_Accelerator.get_op_builder(self, class_name)
        if builder is None:
            return None
        if builder.__name__ == "NotImplementedBuilder":  # "This op had not been implemented on CPU backend."
            return unavailable_builder(class_name, self._adapter)
        return host_builder(builder)

    def device_count(self) -> int:
        launched = node_size()
        return launched if launched is not None else int(CPU_Accelerator.device_count(self))


def _tensor_factory(dtype: torch.dtype, device: Callable[[], str]) -> Callable[..., torch.Tensor]:
    """A ``torch.cuda.FloatTensor``-like constructor for a device without legacy tensor types."""

    def make(*args: Any, **kwargs: Any) -> torch.Tensor:
        kwargs.setdefault("device", device())
        if len(args) == 1 and not isinstance(args[0], int):
            return torch.tensor(args[0], dtype=dtype, **kwargs)
        return torch.empty(*args, dtype=dtype, **kwargs)

    make.__name__ = f"{str(dtype).split('.')[-1]}_tensor"
    return make


class PortspeedAccelerator(AdapterBacked, DeepSpeedAccelerator):
    """DeepSpeed's accelerator interface on any non-CPU portspeed adapter.

    Devices with asynchronous streams are not synchronized devices. Of DeepSpeed's op
    builders only the host-side ones are offered (offload runs on the host on every device);
    device kernels are not, so DeepSpeed uses its torch code paths.
    """

    def __init__(self, adapter: Accelerator) -> None:
        DeepSpeedAccelerator.__init__(self)
        self._compile_backend = "inductor"
        self._unavailable: dict[str, type] = {}
        self._bind(adapter)

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    def device_count(self) -> int:
        launched = node_size()
        return launched if launched is not None else int(self._adapter.device_count())

    def _torch_memory_info(self, device_index: int | None) -> tuple[int, int] | None:
        """(free, total) from ``torch.accelerator`` when the adapter's device is torch's accelerator.

        That is the query every PrivateUse1 / in-tree device answers; a vendor device module
        need not have CUDA's ``get_device_properties`` (the test device has not).
        """
        if not torch.accelerator.is_available():
            return None
        current = torch.accelerator.current_accelerator()
        if current is None or current.type != self._adapter.device_type:
            return None
        index = self.current_device() if device_index is None else int(device_index)
        free, total = torch.accelerator.get_memory_info(index)
        return int(free), int(total)

    def total_memory(self, device_index: int | None = None) -> int:
        info = self._torch_memory_info(device_index)
        return info[1] if info is not None else self._adapter.total_memory(device_index)

    def available_memory(self, device_index: int | None = None) -> int:
        info = self._torch_memory_info(device_index)
        if info is not None:
            return info[0]
        return self.total_memory(device_index) - self.memory_reserved(device_index)

    def lazy_call(self, callback: Callable[[], Any]) -> Any:
        return callback()

    def is_triton_supported(self) -> bool:
        return False

    def create_graph(self) -> None:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    def _factory(self, dtype: torch.dtype) -> Callable[..., torch.Tensor]:
        return _tensor_factory(dtype, self.current_device_name)

    BFloat16Tensor = property(lambda self: self._factory(torch.bfloat16))
    ByteTensor = property(lambda self: self._factory(torch.uint8))
    DoubleTensor = property(lambda self: self._factory(torch.float64))
    FloatTensor = property(lambda self: self._factory(torch.float32))
    HalfTensor = property(lambda self: self._factory(torch.float16))
    IntTensor = property(lambda self: self._factory(torch.int32))
    LongTensor = property(lambda self: self._factory(torch.int64))

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return tensor.device.type == self._adapter.device_type

    def op_builder_dir(self) -> str:
        # the package of DeepSpeed's host builders (what its CPU accelerator answers)
        return CPU_Accelerator.op_builder_dir(self)

    def create_op_builder(self, class_name: str) -> Any:
        builder = self.get_op_builder(class_name)
        if getattr(builder, "unavailable_reason", None):
            return None  # DeepSpeed's answer for "not on this accelerator"
        return builder()

    def get_op_builder(self, class_name: str) -> type:
        served = served_builder(class_name, self._adapter)
        if served is not None:
            return served
        if class_name in HOST_OP_BUILDERS:
            return host_builder(CPU_Accelerator.get_op_builder(self, class_name))
        builder = self._unavailable.get(class_name)
        if builder is None:
            builder = self._unavailable[class_name] = unavailable_builder(class_name, self._adapter)
        return builder

    def build_extension(self) -> Any:
        from torch.utils.cpp_extension import BuildExtension

        return BuildExtension

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        return []

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        return None

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(
                f"compile backend {backend!r} is not available on {self.device_name()}; "
                f"choose one of {supported}"
            )
        self._compile_backend = backend


def build_ds_accelerator(adapter: Accelerator) -> DeepSpeedAccelerator:
    """The DeepSpeed accelerator object for ``adapter`` (see the module docstring)."""
    if not isinstance(adapter, Accelerator):
        raise TypeError(
            f"build_ds_accelerator() takes a portspeed Accelerator, got {type(adapter).__name__}; "
            "pass portspeed.get_accelerator()"
        )
    if adapter.device_type == "cpu":
        return PortspeedCpuAccelerator(adapter)
    return PortspeedAccelerator(adapter)
