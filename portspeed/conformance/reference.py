"""Inputs and exact single-process references for collective checks (the kit's and the test suite's).

Every rank's input is a small integer pattern that depends on the rank, so sums, means,
products and bitwise results over a few ranks are exact in every dtype checked; the
reference is computed in float64 over all ranks' inputs in one process and cast to the
dtype, so results can be compared with ``torch.equal``.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["all_values", "reduce_op", "reference", "values"]


def values(rank: int, shape: tuple[int, ...], dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    """Rank ``rank``'s input, on the host: integers 1..4 laid out by rank and ``salt``."""
    numel = 1
    for s in shape:
        numel *= s
    return ((torch.arange(numel) * 3 + rank * 5 + salt) % 4 + 1).reshape(shape).to(dtype)


def all_values(world: int, shape: tuple[int, ...], salt: int = 0) -> torch.Tensor:
    """Every rank's input stacked on dimension 0, in float64."""
    return torch.stack([values(r, shape, torch.float64, salt) for r in range(world)])


def reference(op: str, stacked: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The reduction ``op`` (a ReduceOp name, or "PREMUL" for PREMUL_SUM by 0.5) of ``stacked``, cast to ``dtype``."""
    op = "PREMUL" if op == "PREMUL_SUM" else op  # the RedOpType's own name (raw checks of a declared gap)
    if op in ("BAND", "BOR", "BXOR"):
        fn = {"BAND": torch.bitwise_and, "BOR": torch.bitwise_or, "BXOR": torch.bitwise_xor}[op]
        ints = stacked.to(torch.int64)
        out = ints[0]
        for t in ints[1:]:
            out = fn(out, t)
        return out.to(dtype)
    f = {"SUM": lambda s: s.sum(0), "AVG": lambda s: s.mean(0), "MAX": lambda s: s.amax(0),
         "MIN": lambda s: s.amin(0), "PRODUCT": lambda s: s.prod(0), "PREMUL": lambda s: (s * 0.5).sum(0)}[op]
    return f(stacked).to(dtype)


def reduce_op(op: str) -> Any:
    """The torch.distributed reduce op named ``op`` ("PREMUL": PREMUL_SUM by 0.5)."""
    import torch.distributed as dist

    return dist._make_nccl_premul_sum(0.5) if op == "PREMUL" else getattr(dist.ReduceOp, op)
