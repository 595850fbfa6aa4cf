"""The device contract: what an adapter answers, how one is found and selected, and what framework code sees.

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
- ``scope``       which modules are framework modules (see the translated torch).
- ``cuda_rules``  the rule kinds the torch.cuda view is written in (delegate, constant,
                  unsupported...) and how a table of them is built, once, into functions.
- ``cuda_view``   ``CudaView``: the torch.cuda API answered by the active adapter, as a table.
- ``torch_namespace`` ``TorchView`` (torch with CUDA device arguments translated) and
                  ``names_cuda`` / ``translate_device`` for the Tensor/Module patches.
- ``translation`` the scoped import: which modules get the views, enable/disable.
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
