"""LayerNorm and RMSNorm as Transformer Engine's ``te.pytorch.LayerNorm`` / ``RMSNorm`` define them.

Why these semantics: Megatron's ``TENorm`` builds them with ``sequence_parallel`` (the
parameters are then marked so ``finalize_model_grads`` all-reduces their gradients across the
tensor-parallel group) and ``zero_centered_gamma`` (the stored weight is ``gamma - 1``, zero at
initialisation: the norm multiplies by ``1 + weight``). The statistics are computed in fp32 and
the result cast back to the input dtype, as TE's kernels do; in fp32 this is
``torch.nn.functional.layer_norm`` / the RMS formula exactly.

Which arithmetic runs is the kernel registry's choice (``kernels``: vendor -> torch -> reference):
``rms_norm_torch`` is ``F.rms_norm`` (torch's fused kernel on CUDA, and a PrivateUse1 backend's
``_fused_rms_norm``; on CPU a decomposition that also computes in fp32: equal to the reference bit
for bit in fp32 and bf16 on torch 2.13), used when the weight's dtype is the input's (else torch
would upcast, with a warning: the reference runs); ``layer_norm_torch`` is ``F.layer_norm`` in the
input's dtype, whose kernels accumulate in fp32 (no upcast copies of ``x``; in bf16 it differs from
the reference by accumulation order only, under one bf16 rounding step).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import PortableModule, resolve_device
from .kernels import kernel
from .refuse import refuse_if

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm", "layer_norm_reference", "layer_norm_torch",
           "rms_norm_reference", "rms_norm_torch"]


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         eps: float) -> torch.Tensor:
    """The ``layer_norm`` contract by upcasting: fp32 copies of the input and parameters, one cast back."""
    if x.dtype == torch.float32:
        return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)
    out = F.layer_norm(x.float(), (x.shape[-1],), weight.float(), None if bias is None else bias.float(), eps)
    return out.to(x.dtype)


def layer_norm_torch(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """The ``layer_norm`` contract on torch's kernel in the input's dtype (it accumulates in fp32)."""
    if weight.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype):
        return layer_norm_reference(x, weight, bias, eps)
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``rms_norm`` contract written out: fp32 statistics and product, one cast back."""
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.float()
    return out.to(x.dtype)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The ``rms_norm`` contract on ``F.rms_norm`` (fused where the device has it) when the dtypes match."""
    if weight.dtype != x.dtype:
        return rms_norm_reference(x, weight, eps)
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm over the last dimension, statistics in fp32, gamma ``1 + weight`` when zero-centred."""
    w = weight + 1 if zero_centered_gamma else weight
    return kernel("layer_norm")(x, w, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension, in fp32, gamma ``1 + weight`` when zero-centred."""
    w = weight + 1 if zero_centered_gamma else weight
    return kernel("rms_norm")(x, w, eps)


class _Norm(PortableModule):
    _has_bias = True

    def __init__(self, normalized_shape: int | None = None, eps: float = 1e-5, sequence_parallel: bool = False,
                 params_dtype: torch.dtype | None = None, zero_centered_gamma: bool = False,
                 device: Any = None, hidden_size: int | None = None, **unsupported: Any) -> None:
        super().__init__()
        # TE 2.x names the size normalized_shape (megatron-core 0.19 passes that); older callers hidden_size
        size = normalized_shape if normalized_shape is not None else hidden_size
        if size is None:
            raise TypeError("LayerNorm / RMSNorm need normalized_shape (or hidden_size)")
        if isinstance(size, (tuple, list)):
            if len(size) != 1:
                raise ValueError(f"normalized_shape {size!r}: only the last dimension can be normalised")
            size = size[0]
        hidden_size = int(size)
        for name, value in unsupported.items():
            refuse_if(value, f"the Transformer Engine norm option {name}={value!r}", f"do not pass {name}")
        dtype = params_dtype or torch.get_default_dtype()
        dev = resolve_device(device)
        self.hidden_size, self.eps = hidden_size, eps
        self.zero_centered_gamma, self.sequence_parallel = zero_centered_gamma, sequence_parallel
        self.weight = torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=dev))
        self.bias = (torch.nn.Parameter(torch.empty(hidden_size, dtype=dtype, device=dev))
                     if self._has_bias else None)
        for p in self.parameters():
            p.sequence_parallel = sequence_parallel  # type: ignore[attr-defined]
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """gamma = 1 (stored as 0 when zero-centred), beta = 0."""
        if self.weight.device.type == "meta":
            return
        with torch.no_grad():
            self.weight.fill_(0.0 if self.zero_centered_gamma else 1.0)
            if self.bias is not None:
                self.bias.zero_()


class LayerNorm(_Norm):
    """``te.pytorch.LayerNorm``: weight and bias over ``hidden_size``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps, self.zero_centered_gamma)


class RMSNorm(_Norm):
    """``te.pytorch.RMSNorm``: weight over ``hidden_size``, no bias."""

    _has_bias = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.zero_centered_gamma)
