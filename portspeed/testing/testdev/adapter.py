"""The portspeed adapter of the test device, written as a third-party vendor would write one.

It reaches the engine only through the public adapter contract: a subclass of the generic
``PrivateUse1Accelerator`` registered in the ``portspeed.adapters`` entry-point group (see
pyproject.toml), whose vendor module is the test device's runtime (imported only when this
adapter is selected; loading this module registers nothing), declaring what its CCL lacks. ``auto_detect`` is False: the
test device is chosen only by name, ``PORTSPEED_ACCELERATOR=testdev``, so CPU runs never
switch to it.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch
import torch.distributed as dist

from portspeed.vendor import BackendGaps, PrivateUse1Accelerator

__all__ = ["TestdevAccelerator"]


class TestdevAccelerator(PrivateUse1Accelerator):
    """portspeed's test device (PrivateUse1 'testdev', collectives on 'testccl'): a test device, not hardware."""

    name: ClassVar[str] = "testdev"
    device_type: ClassVar[str] = "testdev"
    backend: ClassVar[str] = "testccl"
    #: testccl is proven by conformance in CI, so no start check: on torch 2.15 its collectives entered torch's
    #: own flight recorder and moved every collective number the hang tests name (the bare variant's tests use
    #: their own adapter, which is checked)
    ccl_verified: ClassVar[bool] = True
    vendor_modules: ClassVar[tuple[str, ...]] = ("portspeed.testing.testdev.runtime",)
    vendor_package: ClassVar[str | None] = "portspeed's test device (build: python -m portspeed.testing.testdev build)"
    auto_detect: ClassVar[bool] = False
    #: the gaps testccl (csrc/ccl.cpp) really has, so the router rewrites them
    backend_gaps: ClassVar[BackendGaps] = BackendGaps(
        unsupported_ops=(dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM),
        unsupported_dtypes=(("reduce_scatter", torch.bfloat16), ("reduce_scatter_tensor", torch.bfloat16)),
        chunk_shaped_all_gather=True,  # staged through Gloo's _allgather_base: flat outputs raise as on Gloo
        groups_hold_host_threads=True,  # each testccl group owns a staging Gloo group (ccl.py)
        note="testccl, the test device's CCL, lacks this on purpose, like a vendor CCL",
    )

    @classmethod
    def kernels(cls) -> dict[str, Any]:
        """Vendor kernels, to prove the slot on a device that is not the host: ``rms_norm``, and ``attention_lse``
        with its backward (ring context parallelism: torch has no log-sum-exp attention for a PrivateUse1
        device), C++ operators of the device (``kernels.py``, ``csrc/fused.cpp``). Named by import path:
        declaring them loads nothing. (Its fused attention needs no declaration: it reaches torch's SDPA
        through the PrivateUse1 hooks.)"""
        return {op: f"portspeed.testing.testdev.kernels:{op}"
                for op in ("rms_norm", "attention_lse", "attention_lse_backward")}

    @classmethod
    def vendor_build_missing(cls) -> str | None:
        """What must be built before the runtime loads without compiling ("not built: ..."), or None.

        Read by `portspeed info`, which loads no device runtime: a lookup of the build cache only.
        """
        from portspeed.testing.testdev.build import missing_build

        return missing_build()
