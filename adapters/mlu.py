"""The Cambricon MLU adapter: ``torch_mlu`` registers ``torch.mlu``; collectives use CNCL.

torch_mlu follows the torch.cuda API (devices, streams, events, memory statistics,
``default_generators``), so the base class delegates to ``torch.mlu``. What differs:
the backend is ``cncl``, profiling ranges go to ``torch.mlu.cnpx``, and float64 tensors
are computed in float32 without an error, so float64 is reported as unsupported.

Not run on Cambricon hardware by this project: tested against ``tests/fakes/fake_torch_mlu.py``.
"""

from __future__ import annotations

from portspeed.accelerator import Accelerator

__all__ = ["MluAccelerator"]


class MluAccelerator(Accelerator):
    """Cambricon MLU through torch_mlu (Cambricon's wheel ``torch_mlu``) with CNCL."""

    name = "mlu"
    device_type = "mlu"
    backend = "cncl"
    vendor_modules = ("torch_mlu",)
    vendor_package = "torch_mlu"
    verified_on_hardware = False

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
