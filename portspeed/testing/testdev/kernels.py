"""The test device's vendor kernels, for portspeed's kernel slot (``Accelerator.kernels()``).

Why: a vendor with a kernel torch has no operator for (or a faster one than torch's) declares it
on its adapter; the portable Transformer Engine then runs it instead of torch's fused operator or
the reference. The test device proves that route with C++ operators of its own (``csrc/fused.cpp``;
each counts its calls, ``runtime.counters()``), wrapped here as a vendor's Python package wraps its
kernels:

- ``rms_norm``: ``testdev::rms_norm_forward`` / ``rms_norm_backward``, joined into one
  differentiable function;
- ``attention_lse`` / ``attention_lse_backward``: one block of ring context parallelism with its
  log-sum-exp (torch has no such op for a PrivateUse1 device): ``testdev::attention_lse_forward`` /
  ``attention_lse_backward``, a tiled online-softmax kernel of the device's own.

A TEST DEVICE, NOT HARDWARE: the kernels compute on the host CPU, over the device's memory.

The adapter names this module by import path, so declaring the kernels loads nothing (``portspeed
info`` stays instant); the module itself needs the device's runtime only when a kernel is called,
and a device tensor exists only once the runtime is loaded.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.testing.testdev import DEVICE_TYPE

__all__ = ["attention_lse", "attention_lse_backward", "rms_norm"]


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


def _on_device(kernel: str, **tensors: torch.Tensor) -> None:
    """Refuse host tensors by name: the device's kernels take device tensors only, as a real device's would."""
    for name, t in tensors.items():
        if t.device.type != DEVICE_TYPE:
            raise ValueError(f"the test device's {kernel} kernel got {name} on {t.device}; it runs on "
                             f"{DEVICE_TYPE} tensors only (PORTSPEED_ACCELERATOR=testdev)")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``kernel_ops.rms_norm`` on the test device: ``x / sqrt(mean(x^2) + eps) * weight``, statistics in fp32,
    result in ``x``'s dtype; differentiable. Device tensors only (it is the device's kernel)."""
    _on_device("rms_norm", x=x, weight=weight)
    return _RMSNorm.apply(x, weight, float(eps))


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse`` on the test device: ``(out in q's dtype, lse float32 [b, hq, sq])`` of one
    block, top-left ``causal``, grouped-query K/V as they are; not differentiated (its backward is separate)."""
    _on_device("attention_lse", q=q, k=k, v=v)
    with torch.no_grad():
        out, lse = torch.ops.testdev.attention_lse_forward(q, k, v, bool(causal), float(scale))
    return out, lse


def attention_lse_backward(grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, *, causal: bool,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``kernel_ops.attention_lse_backward`` on the test device: the block's ``(dq, dk, dv)`` given the merged
    ``out`` and ``lse`` (``grad_out`` and ``out`` in any floating dtype, read in float32 without a rounding to q's
    dtype first; ``lse`` float32, as the contract)."""
    _on_device("attention_lse_backward", grad_out=grad_out, q=q, k=k, v=v, out=out, lse=lse)
    with torch.no_grad():
        dq, dk, dv = torch.ops.testdev.attention_lse_backward(grad_out, q, k, v, out, lse.float(), bool(causal),
                                                              float(scale))
    return dq, dk, dv
