"""Post-import hooks: run a callback when a module is first imported, and forget them all on revert.

Why: patches are lazy. ``register`` and ``apply`` never import a target module; a patch on
a module that is not imported yet is installed from wrapt's post-import hook the moment it
is. wrapt cannot unregister a hook, so ``forget()`` starts a new generation instead: a hook
from an older generation does nothing when it fires, and the module may be hooked again.
"""

from __future__ import annotations

import threading
import types
from typing import Callable

__all__ = ["ImportHooks"]


class ImportHooks:
    """At most one live hook per module name; ``forget()`` retires every hook registered so far."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock  # the manager's: a hook fires under it, as hook() and forget() are called
        self._modules: set[str] = set()
        self._generation = 0

    def hook(self, module_name: str, on_import: Callable[[types.ModuleType], None]) -> None:
        """Call ``on_import(module)`` when ``module_name`` is first imported (once; a repeat is a no-op)."""
        if module_name in self._modules:
            return
        self._modules.add(module_name)
        generation = self._generation

        def fire(module: types.ModuleType) -> None:
            with self._lock:
                if self._generation != generation:
                    return  # retired by forget(): a newer hook (if any) owns this module
                self._modules.discard(module_name)  # wrapt fires a hook once
                on_import(module)

        import wrapt  # imported when first needed: an adaptor's import loads nothing it does not use yet

        wrapt.register_post_import_hook(fire, module_name)

    def forget(self) -> None:
        """Retire every hook registered so far (they fire into nothing) and allow hooking again."""
        self._generation += 1
        self._modules.clear()

    def pending(self) -> frozenset[str]:
        """The module names with a live hook that has not fired yet."""
        return frozenset(self._modules)
