"""MoE all-to-all token dispatch: the split sizes reach the collective as host numbers, not device tensors.

With expert parallelism, Megatron's ``MoEAlltoAllTokenDispatcher`` counts the tokens each
rank sends and receives on the device, then copies the counts to the host with
``moe_utils.maybe_move_tensor_to_cpu(t, as_numpy=True)`` before it hands them to
``torch.distributed.all_to_all_single`` as ``input_split_sizes`` / ``output_split_sizes``.
That helper converts only ``tensor.is_cuda`` tensors. Off CUDA the counts stay tensors, and
the collective rejects them ("all_to_all_single(): incompatible function arguments": the
split sizes must be a sequence of ints). The wrapper treats a tensor on the adapter's device
as the GPU path treats a CUDA tensor: a copy on the host (a real copy on a host device, as the
GPU path's device-to-host copy is a snapshot), as a NumPy array when asked. Anything else
takes Megatron's own path.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "host_copy_of_device_tensor"]


def host_copy_of_device_tensor(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False)``."""
    tensor = args[0] if args else kwargs.get("tensor")
    if torch.is_tensor(tensor) and not tensor.is_cuda and tensor.device.type == get_accelerator().device_type:
        as_numpy = args[1] if len(args) > 1 else kwargs.get("as_numpy", False)
        host = tensor.to("cpu", copy=True)
        return host.numpy() if as_numpy else host
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(name="megatron.core.moe.host_splits",
          target="megatron.core.transformer.moe.moe_utils:maybe_move_tensor_to_cpu",
          kind=WRAP, impl=host_copy_of_device_tensor, distribution=DISTRIBUTION, versions=CORE, when=translated,
          reason="the all-to-all MoE dispatcher copies its split sizes to the host only from CUDA tensors; off CUDA "
          "they stayed tensors and all_to_all_single rejected them, so copy them from the adapter's device too"),
]
