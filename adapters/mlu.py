"""The Cambricon MLU adapter: ``torch_mlu`` registers the ``mlu`` device and ``torch.mlu``; CNCL.

torch_mlu is a PrivateUse1 device with a torch.cuda-like module, so the generic adapter
covers devices, streams, RNG and memory. What differs: the names; profiling ranges go to
``torch.mlu.cnpx``; float64 tensors are computed in float32 without an error, so float64
is reported as unsupported; and what CNCL lacks (AVG, PREMUL_SUM, bitwise ops) or narrows
(float64, which the router then refuses instead of passing on).

Not run on Cambricon hardware by this project: tested against ``tests/fakes/fake_torch_mlu.py``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from portspeed.vendor import BITWISE_OPS, REDUCING_COLLECTIVES, BackendGaps, PrivateUse1Accelerator

__all__ = ["MluAccelerator"]


class MluAccelerator(PrivateUse1Accelerator):
    """Cambricon MLU through torch_mlu (Cambricon's wheel ``torch_mlu``) with CNCL."""

    name = "mlu"
    device_type = "mlu"
    backend = "cncl"
    vendor_modules = ("torch_mlu",)
    vendor_package = "torch_mlu"
    backend_gaps = BackendGaps(
        unsupported_ops=(dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM, *BITWISE_OPS),
        wrong_dtypes=tuple((c, torch.float64) for c in REDUCING_COLLECTIVES),
        note="CNCL per vendor documentation, not run on hardware here",
    )

    def is_fp64_supported(self) -> bool:
        # The MLU maps double to float silently: a float64 result would not be float64.
        return False

    def range_push(self, msg: str) -> None:
        cnpx = getattr(self.module, "cnpx", None)  # Cambricon's NVTX counterpart
        if cnpx is not None and hasattr(cnpx, "range_push"):
            cnpx.range_push(msg)

    def range_pop(self) -> None:
        cnpx = getattr(self.module, "cnpx", None)
        if cnpx is not None and hasattr(cnpx, "range_pop"):
            cnpx.range_pop()
