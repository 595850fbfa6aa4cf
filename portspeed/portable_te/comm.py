"""The tensor-parallel communication the portable linear layers do, as autograd functions.

Why its own: Transformer Engine's Linear / LayerNormLinear do their own tensor-parallel
communication (given ``tp_group`` and ``parallel_mode``), so the portable ones must too,
without borrowing Megatron's ``tensor_parallel.mappings`` (the layers are tested on their
own, against plain torch). Each function is the forward collective with its transpose as
the backward; collectives go through ``torch.distributed`` and so through portspeed's
collective router like any other. The sequence dimension is dim 0 (Megatron's ``[s, b, h]``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["copy_to_group", "gather_sequence", "reduce_from_group", "reduce_scatter_sequence", "group_size"]


def group_size(group: Any) -> int:
    """World size of ``group`` (1 without a group or without an initialised process group)."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x


def _all_gather0(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    x = x.contiguous()
    out = torch.empty((x.shape[0] * size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(out, x, group=group)
    return out


def _reduce_scatter0(x: torch.Tensor, group: Any) -> torch.Tensor:
    size = group_size(group)
    x = x.contiguous()
    if x.shape[0] % size:
        raise ValueError(f"sequence length {x.shape[0]} is not divisible by the tensor-parallel size {size}")
    out = torch.empty((x.shape[0] // size,) + tuple(x.shape[1:]), dtype=x.dtype, device=x.device)
    dist.reduce_scatter_tensor(out, x, group=group)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _all_gather0(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _reduce_scatter0(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return _reduce_scatter0(x, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _all_gather0(grad, ctx.group), None


def copy_to_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Identity forward, all-reduce backward (the input of a column-parallel layer without SP)."""
    return _Copy.apply(x, group) if group_size(group) > 1 else x


def reduce_from_group(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-reduce forward, identity backward (the output of a row-parallel layer without SP)."""
    return _Reduce.apply(x, group) if group_size(group) > 1 else x


def gather_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """All-gather along dim 0 forward, reduce-scatter backward (column-parallel input with SP)."""
    return _Gather.apply(x, group) if group_size(group) > 1 else x


def reduce_scatter_sequence(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Reduce-scatter along dim 0 forward, all-gather backward (row-parallel output with SP)."""
    return _ReduceScatter.apply(x, group) if group_size(group) > 1 else x
