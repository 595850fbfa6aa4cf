"""The DeepSpeed integration: its patch set, accelerator hook, and the set-up ``portspeed.deepspeed_adaptor`` arranges.

Importing this module does nothing but define. ``defer_activation()`` (what the adaptor's import
calls) validates the PORTSPEED_* environment and arranges for ``activate()`` to run when
``deepspeed`` is first imported, before DeepSpeed's code runs; at once when DeepSpeed is
already imported (``portspeed.integrations.activation``). ``activate()``
- registers ``portspeed.patches.deepspeed`` and, when the collective router is installed,
  ``portspeed.patches.torch_distributed`` into ``portspeed.manager()`` and applies them
  (lazily: each waits for the import of its module);
- sets a post-import hook on ``deepspeed.accelerator.real_accelerator``: when DeepSpeed is
  imported, DeepSpeed's accelerator becomes an object backed by
  ``portspeed.get_accelerator()`` (``portspeed.integrations.ds_accelerator``), placed in the slot
  DeepSpeed's ``set_accelerator`` fills, as a patch, so ``portspeed.manager().revert()``
  gives DeepSpeed its own detection back.

It never imports DeepSpeed itself. ``portspeed.report()`` lists the patches and, on the
``deepspeed.comm.init_distributed.backend`` entry, the backend route taken.

Choices
- An accelerator the program injected itself (``deepspeed.accelerator.set_accelerator``
  with a class not from DeepSpeed) is left in place and logged: that is an explicit choice.
- ``DS_ACCELERATOR`` naming another device than the active adapter's is a contradiction and
  raises ConfigError when DeepSpeed is imported.

Example::

    import portspeed.deepspeed_adaptor  # noqa: F401
    import deepspeed
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg, dist_init_required=True)
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import types
from typing import TYPE_CHECKING, Any

from portspeed.integrations import activation
from portspeed.accelerator import preflight
from portspeed.errors import ConfigError

if TYPE_CHECKING:
    from portspeed.patching.record import Patch

__all__ = ["activate", "deactivate", "deepspeed_patches", "defer_activation", "ds_accelerator_for_adapter"]

#: the public entry point this set-up is known by (``portspeed.integrations.activation.waiting()``, `portspeed run`)
ADAPTOR = "portspeed.deepspeed_adaptor"

log = logging.getLogger("portspeed.deepspeed")

_REAL_ACCELERATOR = "deepspeed.accelerator.real_accelerator"
_lock = threading.RLock()
_built: dict[int, Any] = {}
_hooked = False


def deepspeed_patches() -> list[Patch]:
    """Router + DeepSpeed patches (+ Accelerate's, for the Trainer's ``deepspeed=`` path; + the probe's when
    PORTSPEED_PROBE_DIR is set, the perf recording's collectives when PORTSPEED_PERF is), in registration order."""
    from portspeed.patches import deepspeed as ds_patches
    from portspeed.patches import hf_accelerate, perf, probe
    from portspeed.patches import torch_distributed

    # Accelerate's only where it is installed: a DeepSpeed user without it is no drift (PORTSPEED_STRICT)
    extra = hf_accelerate.PATCHES if importlib.util.find_spec("accelerate") is not None else []
    return [*torch_distributed.PATCHES, *ds_patches.PATCHES, *extra, *probe.for_deepspeed(), *perf.for_deepspeed()]


def ds_accelerator_for_adapter() -> Any:
    """The DeepSpeed accelerator object for the active adapter (one per adapter per process)."""
    from portspeed.accelerator import get_accelerator

    adapter = get_accelerator()
    with _lock:
        acc = _built.get(id(adapter))
        if acc is None or acc.adapter is not adapter:
            from portspeed.integrations.ds_accelerator import build_ds_accelerator

            acc = build_ds_accelerator(adapter)
            _built[id(adapter)] = acc
        return acc


def _check_ds_accelerator_env(device_type: str) -> None:
    requested = os.environ.get("DS_ACCELERATOR", "").strip()
    if requested and requested != device_type:
        from portspeed.accelerator import get_accelerator

        raise ConfigError(
            f"DS_ACCELERATOR={requested!r} asks DeepSpeed for its own {requested!r} accelerator, but portspeed's "
            f"active adapter is {get_accelerator().name!r} (device {device_type!r}); unset DS_ACCELERATOR, or "
            f"select the matching adapter with PORTSPEED_ACCELERATOR"
        )


def _on_real_accelerator(module: types.ModuleType) -> None:
    """Post-import hook: put the portspeed-backed accelerator in DeepSpeed's slot."""
    current = getattr(module, "ds_accelerator", None)
    if current is not None and not type(current).__module__.startswith(("deepspeed.accelerator.", "portspeed.")):
        log.warning("portspeed: DeepSpeed's accelerator was injected by the program (%s); leaving it in place",
                    type(current).__qualname__)
        return
    acc = ds_accelerator_for_adapter()
    _check_ds_accelerator_env(acc.adapter.device_type)
    module._validate_accelerator(acc)  # DeepSpeed's own conformance check, as set_accelerator does
    if current is not None and current is not acc:
        log.info("portspeed: DeepSpeed had already chosen %s; replacing it with %r", type(current).__qualname__, acc)
    import portspeed
    from portspeed.patches.deepspeed import accelerator_patch

    # register() on an active manager installs at once; on a reverted one it only records
    portspeed.manager().register([accelerator_patch(acc)])


def activate() -> None:
    """Register and apply the DeepSpeed patch set and the accelerator hook (idempotent)."""
    global _hooked
    import wrapt

    import portspeed

    activation.cancel(ADAPTOR)
    preflight.check_device()  # vendor package, this rank's device: before anything is applied
    mgr = portspeed.manager()
    mgr.register(deepspeed_patches())
    mgr.apply()
    with _lock:
        if not _hooked:
            _hooked = True
            wrapt.register_post_import_hook(_on_real_accelerator, _REAL_ACCELERATOR)


def deactivate() -> None:
    """Revert every patch of the process-wide manager (tests); ``activate`` re-applies."""
    import portspeed

    activation.cancel(ADAPTOR)
    portspeed.manager().revert()


def _deepspeed_prefixes() -> tuple[str, ...]:
    return ("deepspeed",)



def defer_activation() -> None:
    """Check the PORTSPEED_* settings, then run ``activate`` at DeepSpeed's first import (at once if it is imported).

    A bad PORTSPEED_* value fails here, at the adaptor's import, not at DeepSpeed's.
    """
    preflight.check_settings()
    activation.defer(ADAPTOR, _deepspeed_prefixes, activate)
