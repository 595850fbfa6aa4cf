"""The Intel Gaudi (Habana) adapter: ``habana_frameworks.torch`` registers ``torch.hpu``; HCCL.

Importing ``habana_frameworks.torch`` registers the ``hpu`` device and ``torch.hpu``;
importing ``habana_frameworks.torch.distributed.hccl`` registers the ``hccl`` c10d
backend, so both are vendor modules. The generic adapter covers the rest; where
torch.hpu differs from it, this file says so:

- the default generators live in ``torch.hpu.random``;
- ``synchronize``, ``current_stream`` and ``default_stream`` take no device index
  (one process drives one Gaudi);
- there is no cache to empty, and total memory is the ``Limit`` memory statistic;
- Gaudi has no float64, and first-generation Gaudi no float16 (asked of the bridge);
- Habana's HCCL (not Ascend's, whose name it shares) has no PRODUCT, AVG or bitwise ops.

Not run on Gaudi hardware by this project: tested against ``tests/fakes/fake_habana.py``.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.distributed as dist

from portspeed.vendor import BITWISE_OPS, BackendGaps, PrivateUse1Accelerator

__all__ = ["HpuAccelerator"]


class HpuAccelerator(PrivateUse1Accelerator):
    """Intel Gaudi through the Habana PyTorch bridge (``habana-torch-plugin``) with HCCL."""

    name = "hpu"
    device_type = "hpu"
    backend = "hccl"
    vendor_modules = ("habana_frameworks.torch", "habana_frameworks.torch.distributed.hccl")
    vendor_package = "habana-torch-plugin"
    verified_on_hardware = False
    backend_gaps = BackendGaps(
        unsupported_ops=(dist.ReduceOp.PRODUCT, dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM, *BITWISE_OPS),
        note="HCCL (Habana) per vendor documentation, not run on hardware here",
    )

    def synchronize(self, index: int | None = None) -> None:
        self.module.synchronize()

    def default_generator(self, index: int | None = None) -> torch.Generator:
        return self.module.random.default_generators[self._index(index)]

    def current_stream(self, index: int | None = None) -> Any:
        return self.module.current_stream()

    def default_stream(self, index: int | None = None) -> Any:
        return self.module.default_stream()

    def empty_cache(self) -> None:
        # The Gaudi allocator keeps no cache that user code can release.
        pass

    def total_memory(self, index: int | None = None) -> int:
        return int(self.memory_stats(index)["Limit"])

    def is_fp16_supported(self) -> bool:
        try:
            experimental = importlib.import_module("habana_frameworks.torch.utils.experimental")
            return bool(experimental._is_fp16_supported())
        except (ImportError, AttributeError):
            return True  # Gaudi2 and later; the bridge is too old to ask

    def is_fp64_supported(self) -> bool:
        return False
