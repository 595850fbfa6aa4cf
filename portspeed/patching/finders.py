"""Import-finder patches on ``sys.meta_path``: put one in place, take it off.

Why a patch kind of its own: a module that fails at its own import off CUDA (``import
triton`` at its top) cannot be patched by attribute, so the change is where it is found.
The manager calls these two functions for ``Patch(kind="finder")`` records, so such a
change is gated, reported and reverted like every other (``portspeed.patching.record``).
"""

from __future__ import annotations

import contextlib
import sys
from typing import TYPE_CHECKING, Any

from portspeed.patching.record import FINDER

if TYPE_CHECKING:
    from portspeed.patching.status import PatchRecord

__all__ = ["install", "install_records", "remove", "take"]


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


def take(by_module: dict[str, list["PatchRecord"]]) -> list["PatchRecord"]:
    """Remove the finder patches from ``by_module`` (they change sys.meta_path, not an attribute); return them."""
    taken: list["PatchRecord"] = []
    for module in list(by_module):
        rest = [r for r in by_module[module] if r.patch.kind != FINDER]
        taken += [r for r in by_module[module] if r.patch.kind == FINDER]
        if rest:
            by_module[module] = rest
        else:
            del by_module[module]
    return taken


def install_records(records: list["PatchRecord"], installed: list["PatchRecord"]) -> None:
    """Install each finder record and mark it applied; ``installed`` collects them for a rollback."""
    for r in records:
        install(r.patch.impl, r.patch.placement)
        installed.append(r)
        r.status, r.detail = "applied", f"finder {r.patch.placement} on sys.meta_path"
