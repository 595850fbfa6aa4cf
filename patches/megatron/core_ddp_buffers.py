"""Megatron-Core DDP param/grad buffers: the "offload to host" copy must be a copy on a host device.

``_ParamAndGradBuffer.offload_to_cpu(move_params=True)`` keeps ``param_data.cpu().pin_memory()``
and then frees ``param_data``'s storage. On CUDA that is a device-to-host copy. When the
parameters already live on the CPU, ``.cpu()`` returns the same tensor (no copy), so
freeing the storage would free the only copy, and ``pin_memory()`` raises on a build
without an accelerator. The wrapper makes the host copy a real clone (unpinned: there is
no device to pin for) and leaves the rest, grads included, to Megatron.

Everything else in the buffers needs no patch: they are allocated on
``torch.cuda.current_device()`` (the adapter's device through the translation), the
communication stream is the adapter's stream (a null stream on CPU, where every op is
already ordered), and the bucket collectives go through torch.distributed and the router;
``tests/test_megatron_core_parity.py`` checks DP2, the distributed optimizer and
overlapped grad reduce / param gather against TP1.
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator.conditions import device_is_host
from portspeed.patching.record import WRAP, Patch

from .ranges import DDP_OFFLOAD, DISTRIBUTION

__all__ = ["PATCHES", "offload_to_cpu"]


def offload_to_cpu(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Host-resident params: clone them before Megatron frees the storage."""
    move_params = args[0] if args else kwargs.get("move_params", True)
    move_grads = args[1] if len(args) > 1 else kwargs.get("move_grads", True)
    data = getattr(instance, "param_data", None)
    if (move_params and data is not None and data.device.type == "cpu" and data.storage().size() > 0):
        instance.param_data_size = data.storage().size()
        if instance.param_data_cpu is not None:
            instance.param_data_cpu.copy_(data)
        else:
            instance.param_data_cpu = data.detach().clone()
        data.storage().resize_(0)
        return wrapped(move_params=False, move_grads=move_grads)
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(name="megatron.core.ddp_buffers.offload_copy",
          target="megatron.core.distributed.param_and_grad_buffer:_ParamAndGradBuffer.offload_to_cpu",
          kind=WRAP, impl=offload_to_cpu,
          reason="on a host device .cpu() is no copy, so offloading then freeing the storage would lose the parameters",
          distribution=DISTRIBUTION, versions=DDP_OFFLOAD, when=device_is_host),
]
