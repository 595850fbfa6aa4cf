"""The Intel Gaudi (Habana) adapter: ``habana_frameworks.torch`` registers ``torch.hpu``; HCCL.

Importing ``habana_frameworks.torch`` registers the ``hpu`` device and ``torch.hpu``;
importing ``habana_frameworks.torch.distributed.hccl`` registers the ``hccl`` c10d backend,
so both are vendor modules. What differs from torch.cuda: the default generators live in
``torch.hpu.random``; there is no caching-allocator reserve (``memory_reserved`` is read
from ``memory_stats`` when present); Gaudi has no float64.

Not run on Gaudi hardware by this project: tested against ``tests/fakes/fake_habana.py``.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.accelerator import Accelerator

__all__ = ["HpuAccelerator"]


class HpuAccelerator(Accelerator):
    """Intel Gaudi through the Habana PyTorch bridge (``habana-torch-plugin``) with HCCL."""

    name = "hpu"
    device_type = "hpu"
    backend = "hccl"
    vendor_modules = ("habana_frameworks.torch", "habana_frameworks.torch.distributed.hccl")
    vendor_package = "habana-torch-plugin"
    verified_on_hardware = False

    def default_generator(self, index: int | None = None) -> torch.Generator:
        random = getattr(self.module, "random", None)
        gens = getattr(random, "default_generators", None) or self.module.default_generators
        return gens[self._index(index)]

    def memory_reserved(self, index: int | None = None) -> int:
        return int(self.memory_stats(index).get("Reserved", self.memory_allocated(index)))

    def max_memory_reserved(self, index: int | None = None) -> int:
        return int(self.memory_stats(index).get("MaxReserved", self.max_memory_allocated(index)))

    def memory_stats(self, index: int | None = None) -> dict[str, Any]:
        return dict(self.module.memory_stats(index))

    def is_fp64_supported(self) -> bool:
        return False

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass
