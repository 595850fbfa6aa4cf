"""Megatron patches, one module per thing patched; each module exports ``PATCHES: list[Patch]``.

``all_patches()`` collects them by walking this package, so adding a patch module needs
no edit here, and attaches each one's recorded target fingerprints (``fingerprints.py``,
written by ``portspeed patches --check SOURCE --record``; see ``portspeed.patching.drift``).
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil

from portspeed.patching.record import Patch

__all__ = ["all_patches"]


def all_patches() -> list[Patch]:
    """Every Megatron patch, module by module in name order."""
    out: list[Patch] = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda i: i.name):
        mod = importlib.import_module(f"{__name__}.{info.name}")
        out.extend(getattr(mod, "PATCHES", []))
    from .fingerprints import FINGERPRINTS

    return [dataclasses.replace(p, fingerprints=FINGERPRINTS[p.name]) if p.name in FINGERPRINTS else p for p in out]
