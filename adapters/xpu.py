"""The Intel GPU adapter: native ``torch.xpu``; collectives use XCCL, or oneCCL's ``ccl``.

torch.xpu ships with torch and is served by ``torch.accelerator``, so the generic adapter
covers devices, streams, RNG and memory, and there is no vendor package to import for
the device itself. What differs: a torch build with XPU is required, and the collective
backend is chosen at run time:
``xccl`` when this torch's c10d has it (torch 2.8+ XPU builds), else ``ccl`` when
``oneccl_bindings_for_pytorch`` imports (it registers ``ccl`` on import), else ``xccl``
so that process-group creation fails with torch's own message.
float64 exists only on GPUs whose properties say ``has_fp64`` (Arc and some iGPUs lack it).
Both backends are oneCCL and share one declaration of what it lacks.

Not run on Intel hardware by this project: tested against ``tests/fakes/fake_torch_xpu.py``.
"""

from __future__ import annotations

import importlib
import logging

import torch
import torch.distributed as dist

from portspeed.vendor import BITWISE_OPS, BackendGaps, MissingVendorPackageError, PrivateUse1Accelerator

__all__ = ["XpuAccelerator"]

log = logging.getLogger("portspeed.adapters.xpu")


def _c10d_has_xccl() -> bool:
    probe = getattr(dist, "is_xccl_available", None)
    if probe is not None:
        try:
            return bool(probe())
        except Exception:  # pragma: no cover - a broken probe means "no"
            return False
    return "xccl" in getattr(dist.Backend, "backend_list", [])


def _oneccl_imports() -> bool:
    try:
        importlib.import_module("oneccl_bindings_for_pytorch")
    except ImportError:
        return False
    return True


class XpuAccelerator(PrivateUse1Accelerator):
    """Intel Data Center / Arc GPUs through native torch.xpu with XCCL (or oneCCL's ``ccl``)."""

    name = "xpu"
    device_type = "xpu"
    backend = "xccl"
    vendor_modules = ()
    vendor_package = "torch (XPU build)"
    backend_gaps = BackendGaps(
        unsupported_ops=(dist.ReduceOp.AVG, dist.ReduceOp.PREMUL_SUM, *BITWISE_OPS),
        note="oneCCL: AVG only with recent releases (rewritten to be safe), no bitwise; per vendor documentation",
    )

    @classmethod
    def load_vendor(cls) -> None:
        """XPU needs no extra package, but it does need a torch built with XPU support."""
        xpu = getattr(torch, "xpu", None)
        compiled = getattr(xpu, "_is_compiled", None)
        if xpu is None or (compiled is not None and not compiled()):
            raise MissingVendorPackageError(
                f"the 'xpu' adapter needs a torch built with XPU support, and torch {torch.__version__} "
                "is not; install one (pip install torch --index-url https://download.pytorch.org/whl/xpu), "
                "or pick another adapter with PORTSPEED_ACCELERATOR (see `portspeed info`)"
            )

    @property
    def communication_backend(self) -> str:
        """PORTSPEED_BACKEND, else xccl when c10d has it, else ccl when oneCCL imports (decided once)."""
        if self._backend_override:
            return self._backend_override
        resolved = self.__dict__.get("_resolved_backend")
        if resolved is None:
            resolved = self.__dict__["_resolved_backend"] = self._resolve_backend()
        return resolved

    def owns_backend(self, backend: str) -> bool:
        """xccl and oneCCL's ccl are one library: the declared gaps apply to both."""
        return backend.lower() in ("xccl", "ccl")

    @staticmethod
    def _resolve_backend() -> str:
        if _c10d_has_xccl():
            return "xccl"
        if _oneccl_imports():
            return "ccl"
        log.warning(
            "portspeed: this torch has no 'xccl' backend and oneccl_bindings_for_pytorch is not "
            "installed; XPU collectives will fail (pip install oneccl_bind_pt, or use torch>=2.8 XPU)"
        )
        return "xccl"

    def is_fp64_supported(self) -> bool:
        try:
            return bool(getattr(self.module.get_device_properties(self.current_device()), "has_fp64", True))
        except Exception:
            return False
