"""Import this (before or after Megatron: order does not matter) to run Megatron on the active adapter.

The public entry point, as ``mindspeed.megatron_adaptor`` is for MindSpeed::

    import portspeed.megatron_adaptor   # at the top of the stock pretrain_gpt.py

Importing it validates the PORTSPEED_* environment (a bad value fails here) and arranges
for ``activate()`` to run just before Megatron's first module loads (at once when Megatron
is already imported). What ``activate()`` does lives in ``portspeed.integrations.megatron``;
this module names it, and its import is the one that arranges the set-up.
"""

from __future__ import annotations

from portspeed.integrations.megatron import activate, deactivate, defer_activation, megatron_patches
from portspeed.lazy import lazy_exports

# loaded on first use (it imports the Megatron patch modules' common part)
__getattr__, __dir__ = lazy_exports(__name__, {"note_fallback": "portspeed.integrations.megatron"})

__all__ = ["activate", "deactivate", "megatron_patches", "note_fallback"]

defer_activation()
