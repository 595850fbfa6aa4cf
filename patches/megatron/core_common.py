"""Shared bits of the Megatron-Core patch modules: the supported range and the accelerator condition."""

from __future__ import annotations

from portspeed.accelerator import Accelerator

__all__ = ["CORE_DIST", "CORE_VERSIONS", "not_cuda"]

#: Distribution the core_* patches are written for.
CORE_DIST = "megatron-core"
#: Written for 0.15 and checked against every release to 0.19 (docs/megatron.md); open-ended, so a newer
#: release keeps them (with the untested-release warning of versions.SUPPORTED) until one drifts.
CORE_VERSIONS = ">=0.15"


def not_cuda(acc: Accelerator) -> bool:
    """Condition: the adapter is not CUDA (on CUDA, Megatron's own code paths are right)."""
    return acc.device_type != "cuda"
