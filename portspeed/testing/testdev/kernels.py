"""The test device's vendor kernels, for portspeed's kernel slot (``Accelerator.kernels()``).

Why: a vendor with a kernel torch has no operator for (or a faster one than torch's) declares it
on its adapter; the portable Transformer Engine then runs it instead of torch's fused operator or
the reference. The test device proves that route with one kernel, ``rms_norm``: the C++ operators
``testdev::rms_norm_forward`` / ``testdev::rms_norm_backward`` (``csrc/fused.cpp``; they count
their calls, ``runtime.counters()``), joined into one differentiable function here, as a vendor's
Python package joins its kernels. A TEST DEVICE, NOT HARDWARE: the kernels compute on the host.

The adapter names this module by import path, so declaring the kernel loads nothing (``portspeed
info`` stays instant); the module itself needs the device's runtime only when a kernel is called,
and a device tensor exists only once the runtime is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.testing.testdev import DEVICE_TYPE

__all__ = ["rms_norm"]


class _RMSNorm(torch.autograd.Function):
    """Autograd over the device's two operators; the backward reuses the forward's ``1 / rms``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd = torch.ops.testdev.rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        x, weight, rstd = ctx.saved_tensors
        grad_x, grad_weight = torch.ops.testdev.rms_norm_backward(grad.contiguous(), x, weight, rstd)
        return (grad_x if ctx.needs_input_grad[0] else None, grad_weight if ctx.needs_input_grad[1] else None, None)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kernel_ops.rms_norm`` on the test device: ``x / sqrt(mean(x^2) + eps) * weight``, statistics in fp32,
    result in ``x``'s dtype; differentiable. Device tensors only (it is the device's kernel)."""
    for name, t in (("x", x), ("weight", weight)):
        if t.device.type != DEVICE_TYPE:
            raise ValueError(f"the test device's rms_norm kernel got {name} on {t.device}; it runs on "
                             f"{DEVICE_TYPE} tensors only (PORTSPEED_ACCELERATOR=testdev)")
    return _RMSNorm.apply(x, weight, float(eps))
