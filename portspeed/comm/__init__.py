"""Collectives: which backend a group really runs on, what that backend lacks, and the rewrites.

Layer: engine. Imports the foundation and ``portspeed.accelerator`` (the active adapter
declares its backend's gaps); never a patch and never a framework. The patches in
``portspeed.patches.torch_distributed`` wire these functions onto ``torch.distributed``.

- ``capabilities``  what a backend lacks (``Capabilities``, ``BackendGaps``), torch's defaults.
- ``router``        backend names, group wrappers, rewrites and the hot path (being split).

Public: ``real_backend(group)`` (the backend a group really runs on, whatever name the
framework asked for), ``requested_backend``, ``map_backend``, ``capabilities_of``, ``stats``.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "real_backend": ".router",
    "requested_backend": ".router",
    "map_backend": ".router",
    "capabilities_of": ".router",
    "use_capabilities": ".router",
    "stats": ".router",
    "reset_stats": ".router",
    "Capabilities": ".capabilities",
    "BackendGaps": ".capabilities",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
