"""MoE router gating without Transformer Engine on megatron-core 0.15 and 0.16.

Those releases import ``te_general_gemm`` only inside ``try: import transformer_engine``
and never bind it otherwise, yet the router's gating linear tests ``te_general_gemm is not
None``: without Transformer Engine (every machine without an NVIDIA GPU, and GPU machines
without TE) the first MoE forward dies with ``NameError: name 'te_general_gemm' is not
defined``. From 0.17 the module binds it to None itself, so the patch is gated to
``>=0.15,<0.17``: it binds the missing name to None before the gating linear runs, and
Megatron's own torch path (``torch.mm`` / ``torch.addmm``) computes the logits.
"""

from __future__ import annotations

import sys
from typing import Any

from portspeed.patching.record import WRAP, Patch

from .ranges import DISTRIBUTION, MOE_TE_GEMM_UNBOUND

__all__ = ["PATCHES", "bind_missing_te_gemm"]

_MOD = "megatron.core.transformer.moe.moe_utils"


def bind_missing_te_gemm(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``router_gating_linear``: bind ``te_general_gemm = None`` where the module left it unbound."""
    mod = sys.modules.get(_MOD)
    if mod is not None and "te_general_gemm" not in mod.__dict__:
        mod.__dict__["te_general_gemm"] = None
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(name="megatron.core.moe.te_gemm_unbound", target=f"{_MOD}:router_gating_linear", kind=WRAP,
          impl=bind_missing_te_gemm, distribution=DISTRIBUTION, versions=MOE_TE_GEMM_UNBOUND,
          reason="without Transformer Engine, megatron-core 0.15/0.16 leave te_general_gemm unbound and the MoE "
          "router's gating linear raises NameError; bind it to None so Megatron's torch path runs"),
]
