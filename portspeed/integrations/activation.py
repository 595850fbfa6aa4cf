"""Deferred adaptor activation: an adaptor sets itself up when its framework is first imported.

Why: ``import portspeed.megatron_adaptor`` sits at the top of every training script and of
every process that re-imports it (launch workers, DataLoader workers started with spawn).
Setting up (choosing the adapter, scoping the translation, registering and applying the
patches, rebinding stale references) costs tens of milliseconds, and is needed only once
the framework is there. So an adaptor's import registers a trigger, and the set-up runs
*just before the framework's first module is found*: before any framework code runs, as
if it had run at the adaptor's import.

Contract
- ``defer(name, prefixes, activate)``: ``prefixes()`` gives the framework's module-name
  prefixes (read at each import, so prefixes added later count). When a module named by a
  prefix is already imported (it is imported before any module under it), run ``activate``
  now; otherwise put a finder first on ``sys.meta_path`` that, on the first import of a
  module equal to or under a prefix, removes itself, runs ``activate`` and then finds that
  module with the finders on ``sys.meta_path`` at that moment (so a finder ``activate``
  installed, like the translation's, takes part).
- A trigger fires once; a framework import in another thread meanwhile waits until the
  set-up is done (the interpreter's import lock is held while finders run). An exception
  from ``activate`` propagates from the ``import`` statement that fired it; the adaptor's
  ``activate()`` can be called again to retry.
- ``activate_waiting()`` runs every trigger that has not fired (``portspeed.report()``
  calls it, registered with ``portspeed.before_report`` by the first ``defer``, so a report shows
  what the framework's import would do); ``waiting()`` names the adaptors still waiting.
- Until it fires, a trigger costs a read of the prefixes and a prefix test per module import
  (about 1 µs).
"""

from __future__ import annotations

import importlib.abc
import sys
import threading
from typing import Any, Callable

import portspeed
from portspeed.translation.scope import is_under

__all__ = ["defer", "activate_waiting", "waiting", "cancel"]

_lock = threading.RLock()
_triggers: dict[str, "_FirstImportTrigger"] = {}


class _FirstImportTrigger(importlib.abc.MetaPathFinder):
    """First on sys.meta_path until the first framework import; then runs the set-up and steps aside."""

    def __init__(self, name: str, prefixes: Callable[[], tuple[str, ...]], activate: Callable[[], Any]) -> None:
        self.name = name
        self._prefixes = prefixes
        self._activate = activate
        self._fired = False

    def __repr__(self) -> str:
        return f"<portspeed activation trigger for {self.name}>"

    def fire(self) -> None:
        """Remove the trigger and run the set-up, once.

        A framework import in another thread meanwhile waits for it: CPython calls each
        finder's ``find_spec`` under its global import lock.
        """
        with _lock:
            if self._fired:
                return
            self._fired = True
            if _triggers.get(self.name) is self:
                del _triggers[self.name]
            if self in sys.meta_path:
                sys.meta_path.remove(self)
        self._activate()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if not is_under(fullname, self._prefixes()):
            return None
        self.fire()
        for finder in list(sys.meta_path):
            if finder is self:
                continue
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None


def defer(name: str, prefixes: Callable[[], tuple[str, ...]], activate: Callable[[], Any]) -> bool:
    """Run ``activate`` now if the framework is imported, else just before its first module is.

    Returns True when it ran now. ``name`` identifies the adaptor; deferring it again
    replaces its waiting trigger.
    """
    if any(p in sys.modules for p in prefixes()):
        cancel(name)
        activate()
        return True
    portspeed.before_report(activate_waiting)  # the package root imports nothing above the engine: it is told
    trigger = _FirstImportTrigger(name, prefixes, activate)
    with _lock:
        cancel(name)
        _triggers[name] = trigger
        sys.meta_path.insert(0, trigger)
    return False


def cancel(name: str) -> None:
    """Drop ``name``'s trigger without running it (its ``activate`` was called directly)."""
    with _lock:
        trigger = _triggers.pop(name, None)
        if trigger is not None and trigger in sys.meta_path:
            sys.meta_path.remove(trigger)


def waiting() -> list[str]:
    """The adaptors whose set-up waits for their framework's first import."""
    with _lock:
        return list(_triggers)


def activate_waiting() -> None:
    """Run every set-up still waiting, in the order the adaptors were imported."""
    with _lock:
        pending = list(_triggers.values())
    for trigger in pending:
        trigger.fire()

