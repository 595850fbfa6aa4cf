"""The patch manager: applies declared Patch records, lazily, composably, reversibly.

It orchestrates the pieces beside it: ``gate`` (does a patch apply here), ``install``
(resolve, compose, set and put back targets, with ``targets``, ``chain`` and ``rebind``),
``hooks`` (post-import hooks), ``finders`` (import-finder patches), ``status`` (the records).

Contract
- ``register`` validates and stores patches; two replacements of one target raise
  PatchConflictError naming both (unless one is blocked by PORTSPEED_DISABLE), a second
  patch with the same name but other content raises, re-registering an identical patch
  is a no-op. A failed ``register`` stores nothing.
- ``apply`` gates each patch (PORTSPEED_DISABLE, distribution version range, condition on
  the accelerator), then installs it: at once when its module is already imported, else
  from a post-import hook (wrapt) when the module is first imported. ``register`` and
  ``apply`` never import a target module. Applying twice changes nothing.
- Installing a target composes its chain: the replacement (or the original), then the
  wrappers by (order, registration). Names bound to the original or to a previous chain
  elsewhere (``from x import f``, ``from x import f as g``, class attributes) are rebound
  and recorded; revert restores them by identity.
- ``revert`` restores every original object, and also rebinds aliases taken after
  patching back to the original; ``scoped`` applies a set of patches inside a ``with``
  block only (restored on exit, exception or not). ``apply`` after ``revert`` works.
- Skips (target missing, distribution missing) and failures (condition raised, install
  raised) are recorded with reasons. Versions are read by ``versions.gate_version``: the
  imported package's release where it can differ from the installed one (a checkout on
  PYTHONPATH), said once in the log when it does. A running version outside
  ``versions.SUPPORTED`` warns once (an error under PORTSPEED_STRICT=1). With PORTSPEED_STRICT=1 they raise
  PatchStrictError: from ``apply`` (or ``register`` on an active manager), or from the
  ``import`` of a module whose patches fail. Either way nothing of that batch stays
  installed: targets keep their originals, no hook stays pending for it, and the other
  patches of the batch return to the status they had.
- A ``when`` condition that is false, or a declared version range that excludes the
  running version, makes a patch "inactive": not an error, strict or not, because both are
  declared decisions (this patch is for another device or release), not drift.

Limits: references held in closures, default arguments and containers cannot be rebound,
nor can subclasses of a replaced class; ``report(deep=True)`` lists them (it walks the
garbage collector's referrers, so it is not done on the hot path). Modules under
``portspeed`` (and wrapt, importlib) are never rebound: patches keep references to
originals on purpose. Rebinding matches by identity, so any attribute of a module in
sys.modules (``__main__`` included) or of a top-level class defined there that holds the
original is rebound, whatever its name; originals that are shared immutables (ints,
strings, tuples, None...) are never swept. See docs/patch-manager.md.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import types
from typing import Any, Iterable, Iterator

from portspeed import config
from portspeed.errors import PatchConflictError, PatchDefinitionError, PatchStrictError
from portspeed.patching import finders
from portspeed.patching.gate import VersionCache, check_versions, gate
from portspeed.patching.hooks import ImportHooks
from portspeed.patching.install import (StrictViolation, install_many, mark, resolve_records,
                                        uninstall_many)
from portspeed.patching.rebind import unrebindable
from portspeed.patching.record import FINDER, REPLACE, Patch
from portspeed.patching.status import STATUSES, PatchRecord
from portspeed.patching.targets import MISSING, TargetState

__all__ = ["PatchManager", "PatchRecord", "STATUSES"]


class PatchManager:
    """Holds patches, applies and reverts them. One process-wide instance lives in portspeed.manager()."""

    def __init__(self) -> None:
        self._records: dict[str, PatchRecord] = {}
        self._targets: dict[str, TargetState] = {}
        self._active = False
        self._seq = 0
        self._lock = threading.RLock()
        self._hooks = ImportHooks(self._lock)
        self._said: set[str] = set()  # version warnings given once per manager

    # ------------------------------------------------------------------ register
    def register(self, patches: Iterable[Patch]) -> None:
        """Add patches. Validates names and replacement conflicts before storing any."""
        patches = list(patches)
        with self._lock:
            new = self._validate_new(patches)
            for p in new:
                self._seq += 1
                self._records[p.name] = PatchRecord(p, self._seq)
            if self._active and new:
                try:
                    self._activate([self._records[p.name] for p in new])
                except BaseException:
                    for p in new:
                        self._records.pop(p.name, None)
                    raise

    def _validate_new(self, patches: list[Patch]) -> list[Patch]:
        """The patches not yet registered; raises (storing nothing) on a name clash or a conflict."""
        new: list[Patch] = []
        names: dict[str, Patch] = {}
        for p in patches:
            if not isinstance(p, Patch):
                raise PatchDefinitionError(f"register() takes Patch records, got {type(p).__name__}")
            known = self._records.get(p.name)
            other = known.patch if known is not None else names.get(p.name)
            if other is not None:
                if other == p:
                    continue
                raise PatchConflictError(
                    f"two different patches are named {p.name!r} (targets {other.target} and {p.target}); "
                    "patch names must be unique"
                )
            names[p.name] = p
            new.append(p)
        settings = config.settings()
        replacements = {r.patch.target: r.patch for r in self._records.values()
                        if r.patch.kind == REPLACE and not settings.is_disabled(r.patch.name)}
        for p in new:
            if p.kind == REPLACE and not settings.is_disabled(p.name):
                other = replacements.get(p.target)
                if other is not None:
                    raise _conflict(other, p)
                replacements[p.target] = p
        return new

    # ------------------------------------------------------------------ apply / revert
    def apply(self) -> None:
        """Gate and install every registered patch; idempotent."""
        with self._lock:
            was_active = self._active
            self._active = True
            todo = [r for r in self._records.values() if r.status in ("registered", "reverted")]
            try:
                self._activate(todo)
            except BaseException:
                self._active = was_active
                raise

    def revert(self) -> None:
        """Restore every original object (rebound aliases included) and forget pending hooks."""
        with self._lock:
            self._active = False
            self._hooks.forget()  # hooks registered before this point do nothing when they fire
            uninstall_many(self._targets, list(reversed(list(self._targets))))
            for r in self._records.values():
                if r.patch.kind == FINDER and r.status == "applied":
                    finders.remove(r.patch.impl)
            for r in self._records.values():
                if r.status != "registered":
                    r.status, r.detail = "reverted", ""

    @contextlib.contextmanager
    def scoped(self, patches: Iterable[Patch]) -> Iterator["PatchManager"]:
        """Register and apply ``patches`` for the ``with`` block; remove them after (also on exception)."""
        patches = list(patches)
        with self._lock:
            was_active = self._active
            added = list(dict.fromkeys(p.name for p in patches if p.name not in self._records))
            self.register(patches)  # on an active manager this applies them too
            if not was_active:
                self._active = True
                try:
                    self._activate([self._records[n] for n in added])
                except BaseException:
                    self._active = was_active
                    for n in added:
                        self._records.pop(n, None)
                    raise
        try:
            yield self
        finally:
            with self._lock:
                touched = {self._records[n].patch.target for n in added}
                for n in added:
                    self._records.pop(n, None)
                install_many(self._targets, self._records.values(),
                             [t for t in self._targets if t in touched], full_sweep=True)
                self._active = was_active

    # ------------------------------------------------------------------ report
    def report(self, deep: bool = False) -> list[dict[str, Any]]:
        """Every patch with status, detail, chain and rebinding sites (``deep`` adds unrebindable references)."""
        with self._lock:
            out = []
            for r in sorted(self._records.values(), key=lambda r: r.seq):
                d = r.as_dict()
                st = self._targets.get(r.patch.target)
                if st is not None and r.status == "applied":
                    d["chain"] = list(st.chain)
                    d["rebound"] = [label for _, _, label in st.rebound]
                    if deep:
                        d["unrebindable"] = unrebindable(st, self._targets)
                out.append(d)
            return out

    def chain(self, target: str) -> list[str]:
        """The printable composition of one target, innermost first: original or replacement, then wrappers."""
        st = self._targets.get(target)
        return list(st.chain) if st else []

    def status(self, name: str) -> str | None:
        """The status of the patch registered as ``name`` (None when no such patch is registered)."""
        r = self._records.get(name)
        return None if r is None else r.status

    def note(self, name: str, detail: str) -> None:
        """Set the report's detail line of patch ``name`` (a patch saying what it did at run time).

        Only the detail changes, never the status; an unknown name raises, so a renamed patch
        cannot note into nothing.
        """
        r = self._records.get(name)
        if r is None:
            raise KeyError(f"no patch named {name!r} is registered")
        r.detail = detail

    def records(self) -> list[PatchRecord]:
        """The records in registration order."""
        return sorted(self._records.values(), key=lambda r: r.seq)

    # ------------------------------------------------------------------ gating
    def _activate(self, records: list[PatchRecord]) -> None:
        """Gate ``records``, install those whose module is imported, hook the rest; all or nothing."""
        before = {r.patch.name: (r.status, r.detail) for r in records}
        new_targets: list[str] = []
        installed_finders: list[PatchRecord] = []
        try:
            by_module = self._gate(records)
            finder_records = finders.take(by_module)
            self._check_replacements(by_module)
            targets: list[str] = []
            for m in [m for m in by_module if m in sys.modules]:
                targets += resolve_records(self._targets, sys.modules[m], by_module[m], new_targets)
            self._raise_if_strict([r for r in records if r.status in ("skipped", "failed")])
            if targets:
                install_many(self._targets, self._records.values(), targets, full_sweep=True)
            finders.install_records(finder_records, installed_finders)
        except BaseException as exc:
            strict = exc.records if isinstance(exc, StrictViolation) else []
            self._rollback(records, before, strict, new_targets)
            for r in installed_finders:
                finders.remove(r.patch.impl)
            if isinstance(exc, StrictViolation):
                raise self._strict_error(exc.records) from None
            raise
        for m in by_module:
            if m not in sys.modules:
                self._hooks.hook(m, self._on_import)

    def _gate(self, records: list[PatchRecord]) -> dict[str, list[PatchRecord]]:
        """Set each record's status with ``gate()`` (as `portspeed info` does); group the survivors by module."""
        settings = config.settings()
        by_module: dict[str, list[PatchRecord]] = {}
        seen = VersionCache()
        chosen: list[Any] = []

        def accelerator() -> Any:
            if not chosen:
                from portspeed.accelerator import get_accelerator  # the one place the engine asks for the adapter

                chosen.append(get_accelerator())
            return chosen[0]

        for r in records:
            status, detail = gate(r.patch, settings, accelerator, seen)
            if status in ("skipped", "failed"):
                mark(r, status, detail)
                continue
            r.status, r.detail = status, detail
            if status == "pending":
                by_module.setdefault(r.patch.module, []).append(r)
        check_versions(seen, self._said)
        return by_module

    def _check_replacements(self, by_module: dict[str, list[PatchRecord]]) -> None:
        """Two live replacements of one target (possible when PORTSPEED_DISABLE changed since register)."""
        batch = [r for rs in by_module.values() for r in rs]
        ids = {id(r) for r in batch}
        live: dict[str, Patch] = {r.patch.target: r.patch for r in self._records.values()
                                  if r.patch.kind == REPLACE and r.status in ("applied", "pending")
                                  and id(r) not in ids}
        for r in batch:
            if r.patch.kind == REPLACE:
                other = live.get(r.patch.target)
                if other is not None:
                    raise _conflict(other, r.patch)
                live[r.patch.target] = r.patch

    def _rollback(self, records: list[PatchRecord], before: dict[str, tuple[str, str]],
                  keep: list[PatchRecord], new_targets: list[str]) -> None:
        """Undo a batch's status changes (the violators keep theirs, for the report)."""
        kept = {id(r) for r in keep}
        for r in records:
            if id(r) not in kept:
                r.status, r.detail = before[r.patch.name]
        for t in new_targets:
            st = self._targets.get(t)
            if st is not None and st.installed_value is MISSING:
                del self._targets[t]

    def _on_import(self, module: types.ModuleType) -> None:
        """A hooked module was imported: install its pending patches (under the lock ``ImportHooks`` holds)."""
        if not self._active:
            return
        pending = [r for r in self._records.values()
                   if r.status == "pending" and r.patch.module == module.__name__]
        before = {r.patch.name: ("registered", "") for r in pending}
        new_targets: list[str] = []
        try:
            targets = resolve_records(self._targets, module, pending, new_targets)
            self._raise_if_strict([r for r in pending if r.status in ("skipped", "failed")])
            install_many(self._targets, self._records.values(), targets, full_sweep=False, since=module.__name__)
        except StrictViolation as exc:
            # The import fails (importlib drops the module); call apply() again to retry.
            self._rollback(pending, before, exc.records, new_targets)
            raise self._strict_error(exc.records) from None

    # ------------------------------------------------------------------ strict mode
    def _raise_if_strict(self, violations: list[PatchRecord]) -> None:
        if violations and config.settings().strict:
            raise StrictViolation(violations)

    def _strict_error(self, violations: list[PatchRecord]) -> PatchStrictError:
        what = "; ".join(f"{r.patch.name!r} ({r.patch.target}) {r.status}: {r.detail}" for r in violations)
        return PatchStrictError(
            f"PORTSPEED_STRICT=1 and {what}. Nothing of this batch was applied. Unset PORTSPEED_STRICT "
            "to continue without it, or PORTSPEED_DISABLE it on purpose."
        )


def _conflict(first: Patch, second: Patch) -> PatchConflictError:
    return PatchConflictError(
        f"patches {first.name!r} and {second.name!r} both replace {first.target}; only one replacement "
        "per target is allowed: make one of them a wrapper, or disable one with PORTSPEED_DISABLE"
    )
