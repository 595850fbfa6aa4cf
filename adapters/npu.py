"""The Ascend NPU adapter: ``torch_npu`` registers ``torch.npu``; collectives use HCCL.

torch_npu mirrors the torch.cuda API (devices, streams, events, caching allocator,
``default_generators``), so the base class's delegation to ``torch.npu`` covers almost
everything. What differs: the backend is ``hccl``, float64 is not dependable (only the
newest chips compute it natively), and there is no NVTX (profiling ranges are no-ops).

Not run on Ascend hardware by this project: tested against ``tests/fakes/fake_torch_npu.py``.
"""

from __future__ import annotations

from portspeed.accelerator import Accelerator

__all__ = ["NpuAccelerator"]


class NpuAccelerator(Accelerator):
    """Huawei Ascend through torch_npu (``pip install torch-npu``) with HCCL."""

    name = "npu"
    device_type = "npu"
    backend = "hccl"
    vendor_modules = ("torch_npu",)
    vendor_package = "torch-npu"
    verified_on_hardware = False

    def is_fp64_supported(self) -> bool:
        # Ascend 910A/910B run most float64 kernels through AI-CPU fallbacks or not at all;
        # answering False keeps loss-parity tests from relying on it.
        return False

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass
