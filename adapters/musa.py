"""The Moore Threads MUSA adapter: ``torch_musa`` registers the ``musa`` device and ``torch.musa``; MCCL.

torch_musa is a PrivateUse1 device with a torch.cuda-like module, so the generic adapter
covers devices, streams, RNG and memory. What differs: the names; bfloat16 exists only on
some GPUs and builds, so it is asked of ``torch.musa.is_bf16_supported()`` and reported
False when the build has no such query; and MCCL's bf16 reductions, which only some
builds have (declared missing, so the router reduces in float32).

Not run on Moore Threads hardware by this project: tested against ``tests/fakes/fake_torch_musa.py``.
"""

from __future__ import annotations

import torch

from portspeed.vendor import REDUCING_COLLECTIVES, BackendGaps, PrivateUse1Accelerator

__all__ = ["MusaAccelerator"]


class MusaAccelerator(PrivateUse1Accelerator):
    """Moore Threads GPUs through torch_musa (``pip install torch_musa``) with MCCL."""

    name = "musa"
    device_type = "musa"
    backend = "mccl"
    vendor_modules = ("torch_musa",)
    vendor_package = "torch_musa"
    backend_gaps = BackendGaps(
        unsupported_dtypes=tuple((c, torch.bfloat16) for c in REDUCING_COLLECTIVES),
        note="MCCL supports bf16 only in some builds (upcast to be safe); per vendor documentation",
    )

    def is_bf16_supported(self) -> bool:
        fn = getattr(self.module, "is_bf16_supported", None)
        return bool(fn()) if fn is not None else False
