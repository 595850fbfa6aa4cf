"""The patch engine: declared changes to framework objects, applied lazily, composably, reversibly.

Layer: engine. Imports only the foundation (``errors``, ``config``, ``versions``); it knows
nothing of devices, collectives or frameworks. Patches are data (``Patch`` records) that the
integrations register; the adapter is handed to ``when=`` conditions, never imported here.

- ``record``   ``Patch``: one frozen description of one change.
- ``manager``  ``PatchManager``: registration, gating, install, revert, report.
- ``drift``    upstream drift: patch targets missing or changed in a Megatron source.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "Patch": ".record",
    "REPLACE": ".record",
    "WRAP": ".record",
    "PatchManager": ".manager",
    "PatchRecord": ".manager",
    "STATUSES": ".manager",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
