"""Shared by the megatron.training patches: one-line logs, once per process, on rank 0.

Their range is ``ranges.TRAINING``; their conditions are ``portspeed.accelerator.conditions``.
"""

from __future__ import annotations

import logging
import os

__all__ = ["log_once", "log", "portable_te_path", "PORTABLE_TE_PATCH"]

#: the patch that serves the portable Transformer Engine (patches/megatron/core_portable_te.py)
PORTABLE_TE_PATCH = "megatron.core.transformer_engine.portable"

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


def portable_te_path(args: object) -> bool:
    """Megatron will build its TE layers from portspeed's portable Transformer Engine for these arguments:
    the TE path (``--transformer-impl transformer_engine``, Megatron-LM's default) and the patch applied."""
    import portspeed
    from portspeed.portable_te.serve import requested

    return (getattr(args, "transformer_impl", "transformer_engine") == "transformer_engine" and requested()
            and portspeed.manager().status(PORTABLE_TE_PATCH) == "applied")
