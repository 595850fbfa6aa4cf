"""Import this (before or after DeepSpeed: order does not matter) to run DeepSpeed on the active adapter.

The public entry point for DeepSpeed scripts::

    import portspeed.deepspeed_adaptor   # before (or after) import deepspeed

Importing it validates the PORTSPEED_* environment (a bad value fails here) and arranges
for ``activate()`` to run just before DeepSpeed's first module loads (at once when DeepSpeed
is already imported). What ``activate()`` does lives in ``portspeed.integrations.deepspeed``;
this module names it, and its import is the one that arranges the set-up.
"""

from __future__ import annotations

from portspeed.integrations.deepspeed import (activate, deactivate, deepspeed_patches, defer_activation,
                                              ds_accelerator_for_adapter)

__all__ = ["activate", "deactivate", "deepspeed_patches", "ds_accelerator_for_adapter"]

defer_activation()
