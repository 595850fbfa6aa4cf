"""LayerNorm and RMSNorm as Transformer Engine's ``te.pytorch.LayerNorm`` / ``RMSNorm`` define them.

Why these semantics: Megatron's ``TENorm`` builds them with ``sequence_parallel`` (the
parameters are then marked so ``finalize_model_grads`` all-reduces their gradients across the
tensor-parallel group) and ``zero_centered_gamma`` (the stored weight is ``gamma - 1``, zero at
initialisation: the norm multiplies by ``1 + weight``). The statistics are computed in fp32 and
the result cast back to the input dtype, as TE's kernels do; in fp32 this is
``torch.nn.functional.layer_norm`` / the RMS formula exactly.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from .base import PortableModule, resolve_device
from .refuse import refuse_if

__all__ = ["LayerNorm", "RMSNorm", "layer_norm", "rms_norm"]


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
               zero_centered_gamma: bool) -> torch.Tensor:
    """LayerNorm over the last dimension, statistics in fp32, gamma ``1 + weight`` when zero-centred."""
    w = weight + 1 if zero_centered_gamma else weight
    if x.dtype == torch.float32:
        return F.layer_norm(x, (x.shape[-1],), w, bias, eps)
    out = F.layer_norm(x.float(), (x.shape[-1],), w.float(), None if bias is None else bias.float(), eps)
    return out.to(x.dtype)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool) -> torch.Tensor:
    """RMSNorm over the last dimension, in fp32, gamma ``1 + weight`` when zero-centred."""
    w = weight + 1 if zero_centered_gamma else weight
    xf = x.float()
    out = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    return out.to(x.dtype)


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
