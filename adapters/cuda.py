"""The CUDA adapter: NVIDIA GPUs with NCCL, and AMD GPUs through ROCm (RCCL behind 'nccl').

On CUDA nothing needs translating: torch.cuda is real. The adapter exists so that the
selection, the report and the collective router treat every device alike.
"""

from __future__ import annotations

from typing import Any

import torch

from portspeed.vendor import Accelerator, MissingVendorPackageError

__all__ = ["CudaAccelerator"]


class CudaAccelerator(Accelerator):
    """torch.cuda with NCCL (or RCCL on ROCm, recognised through torch.version.hip)."""

    name = "cuda"
    device_type = "cuda"
    backend = "nccl"
    vendor_package = "torch (CUDA or ROCm build)"
    runs_cuda_natively = True

    @classmethod
    def load_vendor(cls) -> None:
        """CUDA needs no extra package, but it does need a torch built with CUDA or ROCm."""
        if not (torch.backends.cuda.is_built() or getattr(torch.version, "hip", None)):
            raise MissingVendorPackageError(
                f"the 'cuda' adapter needs a torch built with CUDA or ROCm, and torch {torch.__version__} "
                "is a CPU-only build; install a CUDA wheel of torch (https://pytorch.org/get-started), "
                "or pick another adapter with PORTSPEED_ACCELERATOR (see `portspeed info`)"
            )

    @classmethod
    def detect(cls) -> bool:
        return bool(torch.cuda.is_available())

    @property
    def flavor(self) -> str:
        """'rocm' on AMD builds (torch.version.hip set), else 'cuda'."""
        return "rocm" if getattr(torch.version, "hip", None) else "cuda"

    def is_fp16_supported(self) -> bool:
        return True

    def has_grouped_mm(self, dtype: torch.dtype) -> bool:
        """torch documents its grouped GEMM kernel for bf16 on NVIDIA compute capability >= 8.0 (CUTLASS); other
        dtypes, older GPUs and ROCm builds (not in that documentation) keep portspeed's loop."""
        if dtype != torch.bfloat16 or self.flavor != "cuda" or not torch.cuda.is_available():
            return False
        return torch.cuda.get_device_capability() >= (8, 0)

    def describe(self) -> dict[str, Any]:
        d = super().describe()
        d["flavor"] = self.flavor
        return d
