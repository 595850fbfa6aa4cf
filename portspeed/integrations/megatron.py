"""The Megatron integration: its patch set, and the set-up ``import portspeed.megatron_adaptor`` arranges.

Importing this module does nothing but define. ``defer_activation()`` (what the adaptor's import
calls) validates the PORTSPEED_* environment and arranges for ``activate()`` to run when the first
framework module (``megatron``, or a prefix in PORTSPEED_FRAMEWORK_MODULES) is imported, before
that module's code runs; at once when Megatron is already imported
(``portspeed.integrations.activation``). ``activate()``
- scopes the torch / torch.cuda translation onto Megatron's modules
  (``portspeed.translation.importer.enable``; nothing is translated on a CUDA adapter);
- registers the torch_cuda patches, every Megatron patch (``portspeed.patches.megatron``)
  and the collective router (``portspeed.patches.torch_distributed``) into
  ``portspeed.manager()`` and applies them (lazily: a patch whose module is not imported
  yet waits for its import).

It never imports Megatron itself. ``portspeed.report()`` lists what was applied (and sets
up first if Megatron was not imported yet). A program that calls ``torch.distributed``
with a backend the device lacks (``init_process_group("nccl")`` on CPU) *before* importing
Megatron calls ``portspeed.megatron_adaptor.activate()`` first.

A training script's JSON loss record is written by ``portspeed.parity.losslog.open_loss_log``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from portspeed import config
from portspeed.accelerator import preflight
from portspeed.translation import scope as framework_modules
from portspeed.integrations import activation
from portspeed.lazy import lazy_exports

if TYPE_CHECKING:
    from portspeed.patching.record import Patch

__all__ = ["activate", "deactivate", "defer_activation", "megatron_patches", "note_fallback"]

#: the public entry point this set-up is known by (``portspeed.integrations.activation.waiting()``, `portspeed run`)
ADAPTOR = "portspeed.megatron_adaptor"

log = logging.getLogger("portspeed.megatron")

# note_fallback lives beside the patches; re-exported on first use, so the adaptor's import stays cheap
__getattr__, __dir__ = lazy_exports(__name__, {"note_fallback": "portspeed.patches.megatron.core_common"})


def megatron_patches() -> list[Patch]:
    """torch_cuda + router + Megatron patches (+ the probe's when PORTSPEED_PROBE_DIR is set, the perf recording's
    when PORTSPEED_PERF is), in registration order."""
    from portspeed.patches import perf, probe, torch_cuda, torch_distributed
    from portspeed.patches.megatron import all_patches

    return [*torch_cuda.PATCHES, *torch_distributed.PATCHES, *all_patches(), *probe.for_megatron(),
            *perf.for_megatron()]


class _UnlessRootHandles(logging.StreamHandler):
    """stderr output for portspeed records, silent once the root logger has a handler of its own.

    Megatron configures the root logger after the adaptor is imported; records propagate
    there too, and writing them here as well would print every line twice.
    """

    def emit(self, record: logging.LogRecord) -> None:
        if any(not isinstance(h, logging.NullHandler) for h in logging.getLogger().handlers):
            return
        super().emit(record)


def _ensure_log_output() -> None:
    """Make portspeed's own warnings (fallbacks, dropped options) visible on stderr at PORTSPEED_LOG_LEVEL.

    The package logger only has a NullHandler; an application that configured logging
    itself (any non-Null handler on "portspeed" or the root logger) is left alone.
    """
    plog = logging.getLogger("portspeed")
    if any(not isinstance(h, logging.NullHandler) for h in plog.handlers + logging.getLogger().handlers):
        return
    handler = _UnlessRootHandles()
    handler.setFormatter(logging.Formatter("%(message)s"))
    plog.addHandler(handler)
    plog.setLevel(config.settings().log_level)


def activate() -> None:
    """Enable the scoped translation and register + apply the patch set (idempotent)."""
    import portspeed
    from portspeed.translation import importer as translation

    activation.cancel(ADAPTOR)
    _ensure_log_output()
    preflight.check_device()  # vendor package, this rank's device: before anything is applied
    translation.enable()
    mgr = portspeed.manager()
    mgr.register(megatron_patches())
    mgr.apply()


def deactivate() -> None:
    """Revert what ``activate`` did (tests)."""
    import portspeed
    from portspeed.translation import importer as translation

    activation.cancel(ADAPTOR)
    portspeed.manager().revert()
    translation.disable()


def defer_activation() -> None:
    """Check the PORTSPEED_* settings, then run ``activate`` at Megatron's first import (at once if it is imported).

    A bad PORTSPEED_* value fails here, at the adaptor's import, not at Megatron's (and a bad
    PORTSPEED_FRAMEWORK_MODULES too: ``defer`` reads the prefixes at once).
    """
    preflight.check_settings()
    config.check_findable_modules(framework_modules.FRAMEWORK_ENV, framework_modules.env_prefixes())
    activation.defer(ADAPTOR, framework_modules.framework_prefixes, activate)
