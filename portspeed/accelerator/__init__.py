"""The device contract: what an adapter answers, how one is found and selected, and what framework code sees.

Layer: engine. Imports the foundation (``portspeed.errors``, ``config``, ``versions``) and
``portspeed.comm.capabilities`` (an adapter declares its backend's gaps); never a patch
and never a framework.

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
