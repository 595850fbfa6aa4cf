"""The torch.cuda translation: framework modules, and only they, see ``torch`` and ``torch.cuda`` answered by the
active adapter.

Layer: its own floor above ``portspeed.accelerator`` (it imports the foundation and the device contract: the
adapter answers each call); the patches, the integrations, the portable TE and the command line import it;
``portspeed.accelerator`` and ``portspeed.comm`` never do. This file imports nothing, so that ``scope`` (asked
at an adaptor's import, before anything heavy is loaded) costs no torch.

Modules, in import order (each imports only those above it):

- ``scope``           which modules are framework modules (``megatron``, ``PORTSPEED_FRAMEWORK_MODULES``); no torch.
- ``cuda_rules``      the rule kinds the torch.cuda view is written in (delegate, constant, unsupported...) and
                      how a table of them is built, once, into functions.
- ``served_class``    what the views serve in place of a torch class (Stream, Event, autocast, GradScaler).
- ``cuda_view``       ``CudaView``: the torch.cuda API answered by the active adapter, as a table (``CUDA_API``).
- ``torch_namespace`` ``TorchView`` (torch with CUDA device arguments translated) and ``names_cuda`` /
                      ``translate_device`` for the Tensor/Module patches.
- ``importer``        the scoped import: which modules get the views, ``enable()`` / ``disable()``,
                      ``served_import``, ``caller_is_framework``.
"""
