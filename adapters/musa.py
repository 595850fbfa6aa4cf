"""The Moore Threads MUSA adapter: ``torch_musa`` registers ``torch.musa``; collectives use MCCL.

torch_musa follows the torch.cuda API, so the base class delegates to ``torch.musa``.
What differs: the backend is ``mccl``; bfloat16 exists only on some GPUs and builds, so
it is asked of ``torch.musa.is_bf16_supported()`` and reported False when the build has
no such query.

Not run on Moore Threads hardware by this project: tested against ``tests/fakes/fake_torch_musa.py``.
"""

from __future__ import annotations

from portspeed.accelerator import Accelerator

__all__ = ["MusaAccelerator"]


class MusaAccelerator(Accelerator):
    """Moore Threads GPUs through torch_musa (``pip install torch_musa``) with MCCL."""

    name = "musa"
    device_type = "musa"
    backend = "mccl"
    vendor_modules = ("torch_musa",)
    vendor_package = "torch_musa"
    verified_on_hardware = False

    def is_bf16_supported(self) -> bool:
        fn = getattr(self.module, "is_bf16_supported", None)
        return bool(fn()) if fn is not None else False

    def range_push(self, msg: str) -> None:
        pass

    def range_pop(self) -> None:
        pass
