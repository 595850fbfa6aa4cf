"""Shared pieces of the megatron.training patches: the version range, conditions, one-line logs."""

from __future__ import annotations

import logging
import os

from portspeed.accelerator import Accelerator

__all__ = ["DISTRIBUTION", "VERSIONS", "off_cuda", "log_once", "log"]

#: megatron.training is not in the megatron-core wheel; the checkout matching it is gated on its version
DISTRIBUTION = "megatron-core"
#: checked against Megatron-LM tags core_v0.16.1 to core_v0.19.0; a patch whose target a release dropped gates itself
VERSIONS = ">=0.16"

log = logging.getLogger("portspeed.megatron")
_said: set[str] = set()


def off_cuda(acc: Accelerator) -> bool:
    """Patch condition: the adapter is not CUDA (on CUDA, Megatron's own path runs)."""
    return acc.device_type != "cuda"


def _rank() -> int:
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # pragma: no cover - a broken dist must not stop a log line
        pass
    return int(os.environ.get("RANK", "0") or 0)


def log_once(key: str, message: str, *args: object) -> None:
    """Log ``message`` once per process, on rank 0 only (one line per run, not one per rank)."""
    if key in _said:
        return
    _said.add(key)
    if _rank() == 0:
        log.warning(message, *args)
