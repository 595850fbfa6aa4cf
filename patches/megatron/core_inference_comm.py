"""Megatron-Core inference broadcasts: their tensor check asks for CUDA, not for the adapter's device.

``broadcast_from_last_pipeline_stage``, ``send_to_next_pipeline_rank``,
``recv_from_prev_pipeline_rank_`` and friends in ``megatron.core.inference.communication_utils``
assert ``tensor.is_cuda`` through the module's ``_is_cuda`` helper. The replacement checks
that the tensor is on the adapter's device type instead, and says which device it found.
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import REPLACE, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "on_adapter_device"]


def on_adapter_device(tensor: Any) -> None:
    """Assert ``tensor`` exists and lives on the adapter's device type."""
    if tensor is None:
        raise AssertionError("inference broadcast got tensor=None where a tensor is required")
    want = get_accelerator().device_type
    if tensor.device.type != want:
        raise AssertionError(
            f"inference broadcast needs a tensor on the {want!r} device, got one on {tensor.device}; "
            "move it with .to(portspeed.get_accelerator().device())"
        )


PATCHES: list[Patch] = [
    Patch(name="megatron.core.inference_comm.device_check",
          target="megatron.core.inference.communication_utils:_is_cuda", kind=REPLACE, impl=on_adapter_device,
          reason="broadcast_from_last_pipeline_stage and its siblings assert tensor.is_cuda; check the adapter's "
                 "device instead",
          distribution=DISTRIBUTION, versions=CORE, when=translated),
]
