"""Which of DeepSpeed's op builders a portspeed-backed DeepSpeed accelerator offers, and what stands for the rest.

Why: DeepSpeed asks its accelerator for op builders by class name (``get_op_builder``,
``create_op_builder``) and loads the kernel they build. Offload kernels run on the host
whatever the device, so every adapter offers DeepSpeed's host builders. Device kernels
(FusedAdam, transformer kernels...) exist for CUDA only: in their place stands a builder
class that reports itself incompatible and, when loaded, raises ``PortspeedError`` naming
the kernel, the adapter and the torch path to use instead (never a ``None`` DeepSpeed
would call). DeepSpeed's own CPU comm kernels are withheld, since their collectives would
bypass the process group and so the adapter's backend.

Limits: ``unavailable_builder`` imports DeepSpeed's ``OpBuilder``; call it only once
DeepSpeed is imported (the accelerator object is built from DeepSpeed's import hook).
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator import Accelerator
from portspeed.errors import PortspeedError

__all__ = ["COMM_OP_BUILDERS", "HOST_OP_BUILDERS", "host_builder", "unavailable_builder"]

#: DeepSpeed op builders whose kernels do collectives themselves, bypassing torch.distributed.
COMM_OP_BUILDERS = frozenset({"ShareMemCommBuilder", "CCLCommBuilder"})


#: DeepSpeed op builders whose kernels run on the host whatever the device: optimizer steps
#: on host (offloaded) partitions, NVMe async I/O, page-locked host buffers.
HOST_OP_BUILDERS = frozenset({"CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
                              "PinMemoryBuilder"})


#: what to install when a host op cannot be built (DeepSpeed's own error names no package)
INSTALL_HINTS = {
    "AsyncIOBuilder": "DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) needs libaio's headers and library: "
                      "on Debian/Ubuntu run `apt-get install -y libaio-dev` as root (portspeed's set-up: `make "
                      "sysdeps`), elsewhere libaio's development package; then run again (the op is JIT-built)",
}
_hinted: dict[type, type] = {}


def host_builder(builder: type) -> type:
    """DeepSpeed's host builder class, or (for ``INSTALL_HINTS``) a subclass whose ``load`` fails naming what to install.

    DeepSpeed's own ``load`` on a machine without libaio raises "Unable to JIT load the async_io
    op due to it not being compatible due to hardware/software issue. None", which says
    neither what is missing nor how to get it.
    """
    hint = INSTALL_HINTS.get(builder.__name__)
    if hint is None:
        return builder
    if builder not in _hinted:
        def load(self: Any, verbose: bool = True) -> Any:
            if not self.is_compatible(verbose=False):
                raise PortspeedError(f"cannot build DeepSpeed's {builder.__name__} on this machine. {hint}")
            return builder.load(self, verbose=verbose)

        _hinted[builder] = type(builder.__name__, (builder,), {"load": load, "__module__": builder.__module__,
                                                                "__doc__": host_builder.__doc__})
    return _hinted[builder]


def unavailable_builder(class_name: str, adapter: Accelerator) -> type:
    """An op builder class standing for a device kernel the adapter has not: incompatible, and
    loading it raises a clear error (instead of DeepSpeed calling None)."""
    from deepspeed.ops.op_builder.builder import OpBuilder

    message = (
        f"DeepSpeed's {class_name} builds a device kernel, which portspeed does not offer on the "
        f"{adapter.name!r} adapter (device {adapter.device_type!r}); only DeepSpeed's host-side builders "
        f"({', '.join(sorted(HOST_OP_BUILDERS))}) are. Use the torch implementation instead (for Adam: "
        "\"torch_adam\": true in the optimizer params)"
    )

    class UnavailableBuilder(OpBuilder):
        NAME = f"portspeed_unavailable_{class_name}"
        BUILD_VAR = "DS_BUILD_PORTSPEED_UNAVAILABLE"

        def __init__(self) -> None:
            super().__init__(name=self.NAME)

        def absolute_name(self) -> str:
            return f"portspeed.unavailable.{class_name}"

        def sources(self) -> list[str]:
            return []

        def is_compatible(self, verbose: bool = False) -> bool:
            if verbose:
                self.warning(message)
            return False

        def load(self, verbose: bool = True) -> Any:
            raise PortspeedError(message)

        def jit_load(self, verbose: bool = True) -> Any:
            raise PortspeedError(message)

    UnavailableBuilder.__name__ = UnavailableBuilder.__qualname__ = class_name
    UnavailableBuilder.unavailable_reason = message  # type: ignore[attr-defined]
    return UnavailableBuilder
