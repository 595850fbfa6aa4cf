"""The conditions patches are gated on (``Patch(when=...)``), each written once, from declared properties.

A condition reads what an adapter or its collective backend *declares*
(``Accelerator.runs_cuda_natively``, ``Accelerator.device_is_host``,
``Capabilities.sends_from_buffer``...), never a device name: a new adapter gets the right
patches by declaring what it is, without any patch naming it. ``portspeed info`` and the
patch manager evaluate the same functions.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portspeed.accelerator.contract import Accelerator

__all__ = ["translated", "device_is_host", "sends_from_buffer", "groups_hold_host_threads"]


def translated(acc: Accelerator) -> bool:
    """The framework's CUDA calls need translating: the adapter does not run CUDA code natively.

    False on the CUDA adapter (CUDA and ROCm builds), where Megatron's and DeepSpeed's own
    paths are right; True everywhere else.
    """
    return not acc.runs_cuda_natively


def device_is_host(acc: Accelerator) -> bool:
    """The device is the host: device tensors are host tensors (the CPU adapter and the stand-in)."""
    return acc.device_is_host


def sends_from_buffer(acc: Accelerator) -> bool:
    """The adapter's collective backend reads a send buffer after the send call returns (Gloo, the stand-in).

    Such a backend needs a private copy of a buffer the framework reuses before the send
    completes (``Capabilities.sends_from_buffer``).
    """
    return bool(acc.capabilities().sends_from_buffer)


def groups_hold_host_threads(acc: Accelerator) -> bool:
    """The adapter's collective backend keeps host threads per group until it is destroyed (Gloo, testccl).

    Such a backend pays for every group the framework drops without destroying it
    (``Capabilities.groups_hold_host_threads``).
    """
    return bool(acc.capabilities().groups_hold_host_threads)
