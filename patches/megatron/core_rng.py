"""Megatron-Core's CUDA RNG state helpers, answered by the adapter's generator.

``_get_cuda_rng_state`` / ``_set_cuda_rng_state`` reach the device generator through
``torch.cuda.random``, ``torch._C`` and the private ``torch.cuda._lazy_call`` (which on a
CPU build queues the callback forever: a silent no-op). The replacements use the
adapter's ``get_rng_state`` / ``set_rng_state`` directly, so the tracker's per-TP-rank
states are swapped in and out of the adapter's generator (on CPU: ``torch.default_generator``)
and the caller's state is restored after each fork. Graph-safe states are a CUDA-graph
feature and raise a clear error elsewhere.

Limit (CPU): the CPU has one generator, so ``torch.cuda.manual_seed`` seen through the
translation also seeds what ``torch.manual_seed`` seeds; on CUDA they are separate.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.errors import UnsupportedCudaCallError
from portspeed.patching.record import REPLACE, WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES"]


def _index(device: Any) -> int | None:
    if device is None or (isinstance(device, int) and device < 0):
        return None
    if isinstance(device, int):
        return device
    if isinstance(device, str):
        device = torch.device(device)
    return device.index


def _no_graph_safe(graph_safe: bool) -> None:
    if graph_safe:
        raise UnsupportedCudaCallError(
            f"graph-safe RNG states are a CUDA-graph feature; the {get_accelerator().name!r} adapter has none. "
            "Turn off CUDA graphs / use_cudagraphable_rng"
        )


def get_cuda_rng_state(device: Any = "cuda", clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """The adapter generator's state (a fresh tensor, so ``clone`` needs nothing more)."""
    _no_graph_safe(graph_safe)
    return get_accelerator().get_rng_state(_index(device))


def set_cuda_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Set the adapter generator's state now (no lazy queue)."""
    _no_graph_safe(graph_safe)
    get_accelerator().set_rng_state(new_state, _index(device))


def tracker_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """CudaRNGStatesTracker(use_cudagraphable_rng=True) off CUDA: say so at construction, not mid-step."""
    if (args[0] if args else kwargs.get("use_cudagraphable_rng", False)):
        _no_graph_safe(True)
    return wrapped(*args, **kwargs)


_MOD = "megatron.core.tensor_parallel.random"
_COMMON = dict(distribution=DISTRIBUTION, versions=CORE, when=translated)

PATCHES: list[Patch] = [
    Patch(name="megatron.core.rng.get_state", target=f"{_MOD}:_get_cuda_rng_state", kind=REPLACE,
          impl=get_cuda_rng_state,
          reason="reads the device generator through torch.cuda internals; read the adapter's generator instead",
          **_COMMON),
    Patch(name="megatron.core.rng.set_state", target=f"{_MOD}:_set_cuda_rng_state", kind=REPLACE,
          impl=set_cuda_rng_state,
          reason="torch.cuda._lazy_call never runs on a CPU build, so the RNG tracker's fork would silently not "
                 "switch states",
          **_COMMON),
    Patch(name="megatron.core.rng.tracker_graphs", target=f"{_MOD}:CudaRNGStatesTracker.__init__", kind=WRAP,
          impl=tracker_init,
          reason="cudagraph-safe RNG tracking needs CUDA graphs; fail at construction with the fix named",
          **_COMMON),
]
