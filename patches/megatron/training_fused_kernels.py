"""``megatron.legacy.fused_kernels.load`` off CUDA: nothing to build, so nothing to do.

``megatron.training.initialize`` calls ``fused_kernels.load(args)`` on every rank. In
core_v0.15.3 and core_v0.16.1 (the same ``load``) it builds no kernel: it asks ``nvcc -V``
under ``CUDA_HOME`` for the CUDA version (a TypeError when ``CUDA_HOME`` is None, as on any
machine without the CUDA toolkit) and creates a ``build`` folder inside the source tree.
Off CUDA it is replaced by a function that does nothing.
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator.conditions import translated
from portspeed.patching.record import REPLACE, Patch

from .ranges import DISTRIBUTION, LEGACY_FUSED_KERNELS

__all__ = ["PATCHES", "load_nothing"]


def load_nothing(args: Any) -> None:
    """Off CUDA there is no nvcc to probe and no CUDA kernel to load."""
    return None


PATCHES: list[Patch] = [
    Patch(
        name="megatron.legacy.fused_kernels.load",
        target="megatron.legacy.fused_kernels:load",
        kind=REPLACE,
        impl=load_nothing,
        distribution=DISTRIBUTION,
        versions=LEGACY_FUSED_KERNELS,
        when=translated,
        reason="fused_kernels.load probes nvcc under CUDA_HOME (None without a CUDA toolkit) and builds "
        "nothing, so off CUDA it only crashes.",
    ),
]
