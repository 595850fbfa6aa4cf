"""Collectives: which backend a group really runs on, what that backend lacks, and the rewrites.

Layer: engine, above ``portspeed.accelerator``. Imports the foundation, ``portspeed.accelerator``
(the active adapter, and the capability vocabulary it declares its backend's gaps in) and the flight
recorder's recording floor (``portspeed.trace``: torch's recorder turned on before a group, a CCL's staging
groups labelled); never a patch and never a framework, and neither ``portspeed.accelerator`` nor
``portspeed.trace`` imports this package. The patches in ``portspeed.patches.torch_distributed`` wire these
functions onto ``torch.distributed``.

Modules, in import order (each imports only those above it):

- ``backends``      backend names: the one asked for, the one that runs (``map_backend``,
                    ``real_backend``, ``requested_backend``).
- ``groups``        wrappers of torch's group entry points; each group's capability table
                    (``capabilities_of``, ``use_capabilities``).
- ``work``          running a rewrite: ``RewriteWork``, the last step at ``wait()``, coalescing.
- ``rewrites``      the rewrite ladder as a table (``RULES``, ``LADDERS``); ``stats``.
- ``router``        the routed collectives: the hot path (``COLLECTIVE_ROUTES``) and each
                    collective's signature taken apart for a rewrite.

Public: ``real_backend(group)`` (the backend a group really runs on, whatever name the
framework asked for), ``requested_backend``, ``map_backend``, ``capabilities_of``, ``use_capabilities``, ``stats``,
``reset_stats``, ``reset``.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "real_backend": ".backends",
    "requested_backend": ".backends",
    "map_backend": ".backends",
    "capabilities_of": ".groups",
    "use_capabilities": ".groups",
    "RewriteWork": ".work",
    "stats": ".rewrites",
    "explain": ".rewrites",
    "reset_stats": ".rewrites",
    "reset": ".router",
    "Capabilities": "portspeed.accelerator.capabilities",
    "BackendGaps": "portspeed.accelerator.backend_gaps",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
