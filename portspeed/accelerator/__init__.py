"""The device contract: what an adapter answers, and how one is found and selected.

Layer: engine, below ``portspeed.comm``. Imports the foundation (``portspeed.errors``, ``config``,
``versions``) only: never ``portspeed.comm`` (which asks this package for the adapter), never a
patch and never a framework.

- ``capabilities`` the collective vocabulary an adapter declares (``Capabilities``, ``BackendGaps``,
                  backend names, torch's own tables).
- ``kernel_ops``  the vendor kernel slot: the operations an adapter may serve, as contracts.

- ``contract``    ``Accelerator``: the interface every adapter implements, and the
                  properties patches are gated on (``conditions``).
- ``registry``    where adapters come from: built-ins and the ``portspeed.adapters`` entry points.
- ``selection``   which adapter is active (``get_accelerator``, ``set_accelerator``).
- ``conditions``  the declared conditions patches use as ``when=``, written once.

The torch.cuda translation (the views framework modules see, and which modules those are) is its own
package above this one: ``portspeed.translation``.
"""

from __future__ import annotations

from portspeed.lazy import lazy_exports

_PUBLIC = {
    "Accelerator": ".contract",
    "BackendGaps": ".capabilities",
    "Capabilities": ".capabilities",
    "BUILTIN_ADAPTERS": ".registry",
    "DETECTION_ORDER": ".registry",
    "ENTRY_POINT_GROUP": ".registry",
    "adapter_class": ".registry",
    "available_adapters": ".registry",
    "get_accelerator": ".selection",
    "set_accelerator": ".selection",
    "reset_accelerator": ".selection",
    "selection_reason": ".selection",
}
__all__ = sorted(_PUBLIC)
__getattr__, __dir__ = lazy_exports(__name__, _PUBLIC)
