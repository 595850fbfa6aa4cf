"""The patch manager: applies declared Patch records, lazily, composably, reversibly.

It orchestrates the pieces beside it: ``gate`` (does a patch apply here), ``targets``
(resolve, remember, put back), ``chain`` (compose what is installed), ``rebind`` (the
identity sweep and its audit), ``finders`` (import-finder patches), ``status`` (the records).

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
import logging
import sys
import threading
import types
from typing import Any, Iterable, Iterator

from portspeed import config
from portspeed.errors import PatchConflictError, PatchDefinitionError, PatchStrictError
from portspeed.patching import finders
from portspeed.patching.chain import compose
from portspeed.patching.rebind import sweep, unrebindable
from portspeed.patching.record import FINDER, REPLACE, Patch
from portspeed.patching.status import STATUSES, PatchRecord
from portspeed.patching.targets import MISSING, TargetState, put_back, raw_attribute, resolve_target
from portspeed.patching.gate import VersionCache, check_versions, gate
from portspeed.versions import gate_version

__all__ = ["PatchManager", "PatchRecord", "STATUSES"]

log = logging.getLogger("portspeed.patches")

class _StrictViolation(Exception):
    """Internal: a batch hit skipped/failed patches under PORTSPEED_STRICT=1."""

    def __init__(self, records: list[PatchRecord]) -> None:
        super().__init__()
        self.records = records


class PatchManager:
    """Holds patches, applies and reverts them. One process-wide instance lives in portspeed.manager()."""

    def __init__(self) -> None:
        self._records: dict[str, PatchRecord] = {}
        self._targets: dict[str, TargetState] = {}
        self._hooked_modules: set[str] = set()
        self._active = False
        self._generation = 0
        self._seq = 0
        self._lock = threading.RLock()
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
            self._generation += 1  # hooks registered before this point do nothing when they fire
            self._hooked_modules.clear()
            self._uninstall_many(list(reversed(list(self._targets))))
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
                self._install_many([t for t in self._targets if t in touched], full_sweep=True)
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
            finder_records = _take_finders(by_module)
            self._check_replacements(by_module)
            ready = [m for m in by_module if m in sys.modules]
            targets: list[str] = []
            for m in ready:
                targets += self._resolve_records(sys.modules[m], by_module[m], new_targets)
            violations = [r for r in records if r.status in ("skipped", "failed")]
            self._raise_if_strict(violations)
            if targets:
                self._install_many(targets, full_sweep=True)
            for r in finder_records:
                finders.install(r.patch.impl, r.patch.placement)
                installed_finders.append(r)
                r.status, r.detail = "applied", f"finder {r.patch.placement} on sys.meta_path"
        except _StrictViolation as exc:
            self._rollback(records, before, exc.records, new_targets)
            for r in installed_finders:
                finders.remove(r.patch.impl)
            raise self._strict_error(exc.records) from None
        except BaseException:
            self._rollback(records, before, [], new_targets)
            for r in installed_finders:
                finders.remove(r.patch.impl)
            raise
        for m in by_module:
            if m not in sys.modules:
                self._hook(m)

    def _gate(self, records: list[PatchRecord]) -> dict[str, list[PatchRecord]]:
        """Set each record's status with ``gate()`` (the same function `portspeed info` uses); group the survivors by module."""
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
                self._mark(r, status, detail)
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

    def _hook(self, module_name: str) -> None:
        if module_name in self._hooked_modules:
            return
        self._hooked_modules.add(module_name)
        generation = self._generation

        def on_import(module: types.ModuleType) -> None:
            with self._lock:
                if self._generation != generation:
                    return  # reverted since: a newer hook (if any) owns this module
                if not self._active:
                    self._hooked_modules.discard(module_name)
                    return
                self._hooked_modules.discard(module_name)  # wrapt fires a hook once
                pending = [r for r in self._records.values()
                           if r.status == "pending" and r.patch.module == module_name]
                before = {r.patch.name: ("registered", "") for r in pending}
                new_targets: list[str] = []
                try:
                    targets = self._resolve_records(module, pending, new_targets)
                    self._raise_if_strict([r for r in pending if r.status in ("skipped", "failed")])
                    self._install_many(targets, full_sweep=False, since=module_name)
                except _StrictViolation as exc:
                    # The import fails (importlib drops the module); call apply() again to retry.
                    self._rollback(pending, before, exc.records, new_targets)
                    raise self._strict_error(exc.records) from None

        import wrapt  # imported when first needed: an adaptor's import loads nothing it does not use yet

        wrapt.register_post_import_hook(on_import, module_name)

    def _resolve_records(self, module: types.ModuleType, records: list[PatchRecord],
                         new_targets: list[str]) -> list[str]:
        """Find each record's owner object; records whose target is missing become skipped."""
        targets: list[str] = []
        for r in records:
            p = r.patch
            try:
                owner, attr = resolve_target(module, p.attr_path)
            except AttributeError as exc:
                gv = gate_version(p.distribution) if p.distribution else None
                if gv is not None and gv.version is not None:
                    where = f" in {gv.describe(p.distribution)}"
                elif p.distribution:
                    where = f" ({p.distribution} version unknown)"
                else:
                    where = ""
                self._mark(r, "skipped", f"target {p.target} not found{where}: {exc}; the upstream code "
                                         "moved, so this patch needs updating for this version")
                continue
            st = self._targets.get(p.target)
            if st is None or (st.installed_value is MISSING and p.target not in targets):
                # not installed now: (re)read the original, the module may have been reloaded
                raw, own = raw_attribute(owner, attr)
                self._targets[p.target] = TargetState(
                    target=p.target, owner=owner, attr=attr, had_own=own,
                    original_raw=raw, original_value=getattr(owner, attr))
                new_targets.append(p.target)
            if p.target not in targets:
                targets.append(p.target)
        return targets

    # ------------------------------------------------------------------ install / uninstall
    def _live_by_target(self, targets: Iterable[str]) -> dict[str, list[PatchRecord]]:
        """Pending/applied records of each target, in chain order (replacement first, then wrappers)."""
        wanted = {t: [] for t in targets}  # type: dict[str, list[PatchRecord]]
        for r in self._records.values():
            rs = wanted.get(r.patch.target)
            if rs is not None and r.status in ("pending", "applied"):
                rs.append(r)
        for rs in wanted.values():
            rs.sort(key=lambda r: (r.patch.kind != REPLACE, r.patch.order, r.seq))
        return wanted

    def _install_many(self, targets: list[str], full_sweep: bool, since: str | None = None) -> None:
        """Install several targets, then rebind stale references in one sweep; all or nothing under strict."""
        live = self._live_by_target(targets)
        drop = [t for t in targets if not live[t]]
        done: list[tuple[TargetState, Any, Any, tuple[str, ...], list[PatchRecord]]] = []
        failed: list[PatchRecord] = []
        replaced: dict[int, tuple[Any, TargetState]] = {}
        for target in targets:
            records = live[target]
            if not records:
                continue
            st = self._targets[target]
            snapshot = (st, st.installed_raw, st.installed_value, st.chain, records)
            try:
                new_raw, chain = compose(st, records)
                setattr(st.owner, st.attr, new_raw)
                new_value = getattr(st.owner, st.attr)
            except Exception as exc:
                for r in records:
                    self._mark(r, "failed", f"installing on {target} raised {type(exc).__name__}: {exc}")
                failed += records
                continue
            done.append(snapshot)
            previous = st.installed_value
            for r in records:
                r.status, r.detail = "applied", ""
            st.chain, st.installed_raw, st.installed_value = chain, new_raw, new_value
            for old in (st.original_value, previous):
                if old is not MISSING and old is not None and old is not new_value:  # None: an empty slot, not a stale alias
                    replaced[id(old)] = (old, st)
        if failed and config.settings().strict:
            for st, old_raw, old_value, old_chain, _ in reversed(done):
                put_back(st, old_raw)
                st.installed_raw, st.installed_value, st.chain = old_raw, old_value, old_chain
            raise _StrictViolation(failed)
        if drop:
            self._uninstall_many(drop)
        if replaced:
            sweep(replaced, full_sweep=full_sweep, since=since)

    def _uninstall_many(self, targets: list[str]) -> None:
        """Restore originals of ``targets`` and every alias of their installed chains, in one sweep."""
        restored: dict[int, tuple[Any, TargetState]] = {}
        for target in targets:
            st = self._targets.get(target)
            if st is None or st.installed_value is MISSING:
                continue
            installed = st.installed_value
            put_back(st, MISSING)
            for ns, key, _label in st.rebound:
                if ns.get(key) is installed:
                    ns[key] = st.original_value
            st.rebound.clear()
            st.installed_raw = st.installed_value = MISSING
            st.chain = ()
            restored[id(installed)] = (installed, st)
        if restored:
            # aliases taken after patching (`from x import f` once patched) go back too
            sweep(restored, full_sweep=True, since=None, restoring=True)

    # ------------------------------------------------------------------ diagnostics
    def _mark(self, r: PatchRecord, status: str, detail: str) -> None:
        r.status, r.detail = status, detail
        log.warning("portspeed patch %s %s: %s", r.patch.name, status, detail)

    def _raise_if_strict(self, violations: list[PatchRecord]) -> None:
        if violations and config.settings().strict:
            raise _StrictViolation(violations)

    def _strict_error(self, violations: list[PatchRecord]) -> PatchStrictError:
        what = "; ".join(f"{r.patch.name!r} ({r.patch.target}) {r.status}: {r.detail}" for r in violations)
        return PatchStrictError(
            f"PORTSPEED_STRICT=1 and {what}. Nothing of this batch was applied. Unset PORTSPEED_STRICT "
            "to continue without it, or PORTSPEED_DISABLE it on purpose."
        )


def _take_finders(by_module: dict[str, list[PatchRecord]]) -> list[PatchRecord]:
    """Remove the finder patches from ``by_module`` (they change sys.meta_path, not an attribute) and return them."""
    taken: list[PatchRecord] = []
    for module in list(by_module):
        rest = [r for r in by_module[module] if r.patch.kind != FINDER]
        taken += [r for r in by_module[module] if r.patch.kind == FINDER]
        if rest:
            by_module[module] = rest
        else:
            del by_module[module]
    return taken


def _conflict(first: Patch, second: Patch) -> PatchConflictError:
    return PatchConflictError(
        f"patches {first.name!r} and {second.name!r} both replace {first.target}; only one replacement "
        "per target is allowed: make one of them a wrapper, or disable one with PORTSPEED_DISABLE"
    )
