"""SwiGLU's reference arithmetic, the ``swiglu`` operation of the kernel slot.

Why here: Megatron computes the gated activation of its MLP itself (``megatron.core.fusions`` or
its ``glu`` lambda) and reaches Transformer Engine's only through ``--use-te-activation-func``
(``te.pytorch.ops``), which the portable TE refuses; so the portable TE computes no SwiGLU today.
The operation is in the slot for vendors (a fused SwiGLU, as Ascend's ``npu_swiglu``) and for
whatever part of the portable TE comes to compute it: ``kernels.kernel("swiglu")``. torch has no
fused form, so a vendor kernel or this reference serves it; ``portspeed conformance`` checks a
vendor's against this.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["swiglu_reference"]


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """``silu(x[..., :n]) * x[..., n:]`` over the two halves of the last dimension (Megatron's order)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up
