"""Shared bits of the Megatron-Core patch modules: the supported range and the accelerator condition."""

from __future__ import annotations

from portspeed.accelerator import Accelerator

__all__ = ["CORE_DIST", "CORE_VERSIONS", "not_cuda"]

#: Distribution the core_* patches are written for.
CORE_DIST = "megatron-core"
#: Range verified by the tests in tests/test_megatron_core_parity.py (0.16.1).
CORE_VERSIONS = ">=0.15,<0.17"


def not_cuda(acc: Accelerator) -> bool:
    """Condition: the adapter is not CUDA (on CUDA, Megatron's own code paths are right)."""
    return acc.device_type != "cuda"
