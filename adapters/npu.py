"""The Ascend NPU adapter: ``torch_npu`` registers the ``npu`` device and ``torch.npu``; HCCL.

torch_npu is a PrivateUse1 device with a torch.cuda-like module, so the generic adapter
covers devices, streams, RNG and memory. What differs, and is all this file holds: the
names, float64 (not dependable: only the newest chips compute it natively), and what
HCCL lacks (no bitwise reductions, no PREMUL_SUM).

Not run on Ascend hardware by this project: tested against ``tests/fakes/fake_torch_npu.py``.
"""

from __future__ import annotations

import torch.distributed as dist

from portspeed.vendor import BITWISE_OPS, BackendGaps, PrivateUse1Accelerator

__all__ = ["NpuAccelerator"]


class NpuAccelerator(PrivateUse1Accelerator):
    """Huawei Ascend through torch_npu (``pip install torch-npu``) with HCCL."""

    name = "npu"
    device_type = "npu"
    backend = "hccl"
    vendor_modules = ("torch_npu",)
    vendor_package = "torch-npu"
    backend_gaps = BackendGaps(
        unsupported_ops=(*BITWISE_OPS, dist.ReduceOp.PREMUL_SUM),
        note="HCCL (Ascend) per vendor documentation, not run on hardware here",
    )

    def is_fp64_supported(self) -> bool:
        # Ascend 910A/910B run most float64 kernels through AI-CPU fallbacks or not at all;
        # answering False keeps loss-parity tests from relying on it.
        return False
