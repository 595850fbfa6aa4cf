"""Uneven all-gather / reduce-scatter along the first dimension, on backends that need equal sizes.

With MoE token dispatch under tensor + sequence parallelism (``--sequence-parallel
--expert-model-parallel-size N`` with TP > 1), each tensor-parallel rank routes a different
number of tokens, and Megatron gathers them with
``tensor_parallel.mappings._gather_along_first_dim(x, group, output_split_sizes)`` (a list
``all_gather`` into unequal slices) and sends the gradients back with
``_reduce_scatter_along_first_dim(x, group, input_split_sizes)`` (a list ``reduce_scatter``
of unequal slices). NCCL takes unequal slices; Gloo refuses them
("ProcessGroupGloo::allgather: invalid tensor size at index 1 (expected (72, 64), got (67,
64))"). Off CUDA, unequal splits go through the equal-size collectives every backend has:
each rank's slice is zero-padded to the largest split, all-gathered (or reduce-scattered)
with ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, and the padding is cut off. The
values are the same (gathering copies; the padded rows are zeros in the sums, which add the
real rows in the same order); the cost is the padding, at most ``world x (max - min)`` rows.
Equal splits and no splits take Megatron's own path.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "gather_uneven", "reduce_scatter_uneven"]

_MOD = "megatron.core.tensor_parallel.mappings"


def _uneven(sizes: Any) -> list[int] | None:
    """The split sizes as ints when they differ (None: no splits, or all equal)."""
    if sizes is None:
        return None
    ints = [int(s) for s in sizes]
    return ints if len(set(ints)) > 1 else None


def gather_uneven(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_gather_along_first_dim(input_, group, output_split_sizes=None, use_global_buffer=False)``."""
    input_, group = args[0], args[1] if len(args) > 1 else kwargs["group"]
    sizes = _uneven(args[2] if len(args) > 2 else kwargs.get("output_split_sizes"))
    if sizes is None or group is None or group.size() == 1:
        return wrapped(*args, **kwargs)
    longest, rest = max(sizes), tuple(input_.shape[1:])
    padded = input_.new_zeros((longest, *rest))
    padded[: input_.shape[0]] = input_
    out = input_.new_empty((longest * len(sizes), *rest))
    torch.distributed.all_gather_into_tensor(out, padded, group=group)
    return torch.cat([out[r * longest: r * longest + n] for r, n in enumerate(sizes)], dim=0)


def reduce_scatter_uneven(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``_reduce_scatter_along_first_dim(input_, group, input_split_sizes=None, ...)``."""
    input_, group = args[0], args[1] if len(args) > 1 else kwargs["group"]
    sizes = _uneven(args[2] if len(args) > 2 else kwargs.get("input_split_sizes"))
    if sizes is None or group is None or group.size() == 1:
        return wrapped(*args, **kwargs)
    longest, rest = max(sizes), tuple(input_.shape[1:])
    padded = input_.new_zeros((longest * len(sizes), *rest))
    for r, piece in enumerate(torch.split(input_, sizes, dim=0)):
        padded[r * longest: r * longest + sizes[r]] = piece
    out = input_.new_empty((longest, *rest))
    torch.distributed.reduce_scatter_tensor(out, padded, group=group)
    return out[: sizes[group.rank()]].contiguous()


_REASON = ("MoE dispatch under tensor + sequence parallelism gathers and reduce-scatters unequal slices per rank; "
           "Gloo takes only equal sizes, so off CUDA unequal splits are padded to the largest and cut after")

PATCHES: list[Patch] = [
    Patch(name="megatron.core.mappings.uneven_gather", target=f"{_MOD}:_gather_along_first_dim", kind=WRAP,
          impl=gather_uneven, distribution=DISTRIBUTION, versions=CORE, when=translated, reason=_REASON),
    Patch(name="megatron.core.mappings.uneven_reduce_scatter", target=f"{_MOD}:_reduce_scatter_along_first_dim",
          kind=WRAP, impl=reduce_scatter_uneven, distribution=DISTRIBUTION, versions=CORE, when=translated,
          reason=_REASON),
]
