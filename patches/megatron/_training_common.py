"""Shared by the megatron.training patches: one-line logs, once per process, on rank 0.

Their range is ``ranges.TRAINING``; their conditions are ``portspeed.accelerator.conditions``.
"""

from __future__ import annotations

import logging
import os

__all__ = ["log_once", "log"]

log = logging.getLogger("portspeed.megatron")
_said: set[str] = set()


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
