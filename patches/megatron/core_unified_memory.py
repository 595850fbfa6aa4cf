"""Megatron's CUDA unified-memory allocator is not built off CUDA; Megatron then runs without it.

Why: megatron-core 0.15's ``megatron/core/inference/unified_memory.py`` compiles a CUDA
allocator (``cudaMallocManaged``) with ``torch.utils.cpp_extension.load_inline(..., with_cuda=True)``
at import, and every training run imports it (``megatron.training`` -> the inference contexts).
It catches RuntimeError, ImportError and OSError and then runs without unified memory, which is
what happens on a CPU build of torch. On a CUDA build of torch with no GPU (PyPI's default wheel
on a vendor's or a CPU host) torch fails earlier, with an ``IndexError`` from
``_get_cuda_arch_flags`` (no GPU, so no architecture list), and the run dies at import. From 0.16
Megatron compiles the allocator lazily, only for the inference engine's unified-memory option.

So off CUDA that one build (``name="managed_alloc_runtime"``) raises a RuntimeError that says why,
which Megatron catches as it was written to; every other ``load_inline`` call is passed through.
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "ALLOCATOR_EXTENSION", "load_inline"]

#: the extension name Megatron's unified-memory module builds
ALLOCATOR_EXTENSION = "managed_alloc_runtime"


def load_inline(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``torch.utils.cpp_extension.load_inline``: Megatron's CUDA allocator is refused off CUDA."""
    name = kwargs.get("name", args[0] if args else None)
    if name == ALLOCATOR_EXTENSION and kwargs.get("with_cuda"):
        raise RuntimeError(
            f"portspeed: Megatron's unified-memory allocator ({ALLOCATOR_EXTENSION}) is CUDA code and the active "
            f"device is {get_accelerator().device_type!r}; it is not built, and Megatron runs without unified memory")
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(name="megatron.core.unified_memory.not_built", target="torch.utils.cpp_extension:load_inline",
          kind=WRAP, impl=load_inline, distribution=DISTRIBUTION, versions=CORE, when=translated,
          reason="megatron-core 0.15 compiles a CUDA allocator at import; on a CUDA build of torch without a GPU "
          "torch raises an IndexError Megatron does not catch; off CUDA the build raises the RuntimeError it does"),
]
