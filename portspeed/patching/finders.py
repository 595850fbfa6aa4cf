"""Import-finder patches on ``sys.meta_path``: put one in place, take it off.

Why a patch kind of its own: a module that fails at its own import off CUDA (``import
triton`` at its top) cannot be patched by attribute, so the change is where it is found.
The manager calls these two functions for ``Patch(kind="finder")`` records, so such a
change is gated, reported and reverted like every other (``portspeed.patching.record``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import Any

__all__ = ["install", "remove"]


def install(finder: Any, placement: str) -> None:
    """Put ``finder`` first or last on ``sys.meta_path`` (once: an installed finder is left where it is)."""
    if any(f is finder for f in sys.meta_path):
        return
    if placement == "first":
        sys.meta_path.insert(0, finder)
    else:
        sys.meta_path.append(finder)


def remove(finder: Any) -> None:
    """Take ``finder`` off ``sys.meta_path`` (modules already imported through it stay imported)."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(finder)
