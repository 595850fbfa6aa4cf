"""What the portable Transformer Engine refuses, and how it says so.

Why a module of its own: every option the portable layers cannot honour (fp8 / fp4,
userbuffers tensor-parallel overlap, cuDNN-only attention variants, CPU offload hooks, ...)
must stop the run at start-up (model construction, before the first step) with one message
that names the option and the flag that avoids it. Silently ignoring one would train a
different model than the user asked for. ``refuse`` raises ``UnsupportedOptionError``
(a ``ValueError``) in one wording for all of them.
"""

from __future__ import annotations

from typing import Any

from portspeed.errors import UnsupportedOptionError

__all__ = ["UnsupportedOptionError", "refuse", "refuse_if"]

_WHO = "portspeed's portable Transformer Engine (plain torch operations)"


def refuse(option: str, avoid: str) -> None:
    """Raise UnsupportedOptionError naming ``option`` and what avoids it (a flag to drop or to pass)."""
    raise UnsupportedOptionError(
        f"{option} is not implemented by {_WHO}; {avoid} (or run with --transformer-impl local)")


def refuse_if(value: Any, option: str, avoid: str) -> None:
    """``refuse(option, avoid)`` when ``value`` is truthy (an option that was asked for)."""
    if value:
        refuse(option, avoid)
