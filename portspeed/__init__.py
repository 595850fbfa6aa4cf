"""portspeed: run Megatron-LM and DeepSpeed on any accelerator, and prove it with loss parity.

Public surface::

    import portspeed.megatron_adaptor      # before Megatron is imported (or after: order does not matter)
    portspeed.report()                      # what was patched, pending, skipped, failed
    portspeed.get_accelerator()             # the active device adapter

See the README for the status of each adapter and patch set.
"""

from __future__ import annotations

import logging as _logging
import threading as _threading
from typing import TYPE_CHECKING, Any, Callable

from portspeed import teardown as _teardown
from portspeed.errors import PortspeedError
from portspeed.lazy import lazy_exports as _lazy_exports

if TYPE_CHECKING:
    from portspeed.accelerator import Accelerator, get_accelerator, set_accelerator
    from portspeed.patching.manager import PatchManager
    from portspeed.patching.record import REPLACE, WRAP, Patch

__all__ = [
    "Accelerator",
    "Patch",
    "PatchManager",
    "PortspeedError",
    "REPLACE",
    "WRAP",
    "__version__",
    "get_accelerator",
    "manager",
    "report",
    "set_accelerator",
]

__version__ = "0.1.0"

_logging.getLogger("portspeed").addHandler(_logging.NullHandler())
# the groups a script leaves behind are destroyed at exit, before the interpreter's finalization can abort
# a backend thread still finishing a collective (portspeed.teardown; docs/reliability.md)
_teardown.install()

#: Public names served from submodules on first use, so that importing an adaptor (which
#: imports this package) loads nothing it does not need yet (docs/benchmarks.md, import).
_LAZY = {
    "Accelerator": ".accelerator", "get_accelerator": ".accelerator", "set_accelerator": ".accelerator",
    "Patch": ".patching.record", "REPLACE": ".patching.record", "WRAP": ".patching.record",
    "PatchManager": ".patching.manager",
}
__getattr__, _lazy_dir = _lazy_exports(__name__, _LAZY)


def __dir__() -> list[str]:
    return sorted(set(_lazy_dir()) | set(__all__))


_manager: "PatchManager | None" = None
_manager_lock = _threading.Lock()


def manager() -> "PatchManager":
    """The process-wide patch manager that the adaptors register into."""
    global _manager
    if _manager is None:
        with _manager_lock:
            if _manager is None:
                from portspeed.patching.manager import PatchManager

                _manager = PatchManager()
    return _manager


#: what report() runs first (``before_report``): the package root sits below the integrations and the
#: plugins, which import it, so it calls up into them only through what they registered
_before_report: list[Callable[[], Any]] = []


def before_report(fn: Callable[[], Any]) -> None:
    """Run ``fn`` at the start of every ``report()`` (once per registration of the same function).

    ``portspeed.integrations.activation`` registers its ``activate_waiting``: an adaptor whose set-up
    still waits for its framework's first import is set up first, so a report shows what will be patched.
    """
    if fn not in _before_report:
        _before_report.append(fn)


def report(deep: bool = False) -> list[dict]:
    """Every patch of the process-wide manager with its status; ``deep`` also lists unrebindable references.

    An adaptor whose set-up still waits for its framework's first import is set up first (see ``before_report``),
    so the report shows what will be patched.
    """
    for fn in list(_before_report):
        fn()
    return manager().report(deep=deep)
