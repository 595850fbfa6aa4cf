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

__all__ = ["COMM_OP_BUILDERS", "HOST_OP_BUILDERS", "unavailable_builder"]

#: DeepSpeed op builders whose kernels do collectives themselves, bypassing torch.distributed.
COMM_OP_BUILDERS = frozenset({"ShareMemCommBuilder", "CCLCommBuilder"})


#: DeepSpeed op builders whose kernels run on the host whatever the device: optimizer steps
#: on host (offloaded) partitions, NVMe async I/O, page-locked host buffers.
HOST_OP_BUILDERS = frozenset({"CPUAdamBuilder", "CPUAdagradBuilder", "CPULionBuilder", "AsyncIOBuilder",
                              "PinMemoryBuilder"})


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
