"""portspeed: run Megatron-LM and DeepSpeed on any accelerator, and prove it with loss parity.

Public surface::

    import portspeed.megatron_adaptor      # before Megatron is imported (or after: order does not matter)
    portspeed.report()                      # what was patched, pending, skipped, failed
    portspeed.get_accelerator()             # the active device adapter

See the README for the status of each adapter and patch set.
"""

from __future__ import annotations

import logging as _logging

from .accelerator import Accelerator, get_accelerator, set_accelerator
from .errors import PortspeedError
from .manager import PatchManager
from .patch import REPLACE, WRAP, Patch

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

_manager = PatchManager()


def manager() -> PatchManager:
    """The process-wide patch manager that the adaptors register into."""
    return _manager


def report(deep: bool = False) -> list[dict]:
    """Every patch of the process-wide manager with its status; ``deep`` also lists unrebindable references."""
    return _manager.report(deep=deep)
