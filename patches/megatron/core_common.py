"""Shared by the Megatron-Core patch modules: the one log line a CUDA-kernel fallback gives.

Ranges live in ``ranges`` and conditions in ``portspeed.accelerator.conditions``; this
module holds what the patches themselves share at run time. ``note_fallback`` lives here,
beside the patches that call it, so no patch imports the adaptor (the facade
``portspeed.megatron_adaptor`` re-exports it for programs and tests).
"""

from __future__ import annotations

import logging

__all__ = ["note_fallback", "noted_fallbacks"]

log = logging.getLogger("portspeed.megatron")

#: config fields whose fallback was logged in this process
noted_fallbacks: set[str] = set()


def note_fallback(feature: str, reason: str) -> None:
    """Log once per process that a CUDA-kernel default fell back to its torch path."""
    if feature in noted_fallbacks:
        return
    noted_fallbacks.add(feature)
    from portspeed.accelerator import get_accelerator

    log.warning("portspeed: %s has no %s kernel; using the torch path (%s)",
                feature, get_accelerator().name, reason)
