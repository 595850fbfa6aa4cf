"""The patch manager: applies declared Patch records, lazily, composably, reversibly.

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
import dataclasses
import functools
import gc
import logging
import sys
import threading
import types
import warnings
from typing import Any, Iterable, Iterator

from portspeed import config
from portspeed.errors import PatchConflictError, PatchDefinitionError, PatchStrictError
from portspeed.patching import finders
from portspeed.patching.record import FINDER, REPLACE, Patch
from portspeed.patching.gate import VersionCache, gate
from portspeed.versions import SUPPORTED, GateVersion, gate_version

__all__ = ["PatchManager", "PatchRecord", "STATUSES"]

log = logging.getLogger("portspeed.patches")

#: Every status a patch can be in, as shown by the report.
STATUSES = ("registered", "pending", "applied", "skipped", "inactive", "disabled", "failed", "reverted")

#: Top-level packages whose namespaces are never rebound (by package, not by name prefix:
#: a user module called ``portspeed_tools`` is rebound like any other).
_NO_REBIND_PACKAGES = frozenset({"portspeed", "wrapt", "importlib", "_frozen_importlib",
                                 "_frozen_importlib_external"})
_MISSING = object()


@dataclasses.dataclass
class PatchRecord:
    """What happened to one patch; the report is a list of these."""

    patch: Patch
    seq: int
    status: str = "registered"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The record as plain data (what `portspeed patches` prints)."""
        p = self.patch
        return {
            "name": p.name,
            "target": p.target,
            "kind": p.kind,
            "status": self.status,
            "detail": self.detail,
            "reason": p.reason,
            "distribution": p.distribution,
            "versions": p.versions,
            "order": p.order,
        }


@dataclasses.dataclass
class _TargetState:
    """Bookkeeping for one patched attribute."""

    target: str
    owner: Any
    attr: str
    had_own: bool  # the attribute lived in vars(owner), not inherited
    original_raw: Any  # what vars(owner)[attr] held (descriptor included)
    original_value: Any  # what getattr(owner, attr) returned
    installed_raw: Any = _MISSING
    installed_value: Any = _MISSING
    chain: tuple[str, ...] = ()
    rebound: list[tuple[Any, str, str]] = dataclasses.field(default_factory=list)


class _StrictViolation(Exception):
    """Internal: a batch hit skipped/failed patches under PORTSPEED_STRICT=1."""

    def __init__(self, records: list[PatchRecord]) -> None:
        super().__init__()
        self.records = records


def _resolve(module: types.ModuleType, path: tuple[str, ...]) -> tuple[Any, str]:
    """Walk ``path`` from ``module``; return (owner, last attribute name) or raise AttributeError."""
    owner: Any = module
    for part in path[:-1]:
        owner = getattr(owner, part)
    attr = path[-1]
    if isinstance(owner, type):
        for klass in owner.__mro__:
            if attr in vars(klass):
                return owner, attr
        raise AttributeError(f"{owner.__qualname__} has no attribute {attr!r}")
    if not hasattr(owner, attr):
        raise AttributeError(f"{getattr(owner, '__name__', owner)!r} has no attribute {attr!r}")
    return owner, attr


def _raw(owner: Any, attr: str) -> tuple[Any, bool]:
    """The raw attribute (descriptors unbound) and whether it is the owner's own."""
    if isinstance(owner, type):
        if attr in vars(owner):
            return vars(owner)[attr], True
        for klass in owner.__mro__[1:]:
            if attr in vars(klass):
                return vars(klass)[attr], False
    return getattr(owner, attr), True


_is_class = type.__dict__["__instancecheck__"].__get__(type)  # isinstance(x, type), callable from C


def _namespaces(modules: Iterable[Any], ids: Any) -> Iterator[tuple[Any, str]]:
    """Module dicts, and the classes defined in them, that hold an object whose id is in ``ids``.

    This is the hot loop of apply: the membership tests run in C (``isdisjoint`` over
    ``map(id, ...)``, ``filter`` with a C predicate), so the cost is a few tens of
    nanoseconds per namespace entry.
    """
    for mod in modules:
        name = getattr(mod, "__name__", None)
        if not isinstance(name, str) or name.partition(".")[0] in _NO_REBIND_PACKAGES:
            continue
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        values = list(ns.values())
        if not ids.isdisjoint(map(id, values)):
            yield ns, name
        for cls in filter(_is_class, values):
            d = cls.__dict__
            if d.get("__module__") == name and not ids.isdisjoint(map(id, list(d.values()))):
                yield _ClassNamespace(cls), f"{name}.{cls.__qualname__}"


def _rebindable(obj: Any) -> bool:
    """Identity rebinding makes sense for functions, classes and other objects, not for shared immutables."""
    return not isinstance(obj, (int, float, complex, str, bytes, tuple, frozenset, type(None)))


class _ClassNamespace:
    """A class seen as a namespace: read through __dict__, write through setattr."""

    __slots__ = ("cls",)

    def __init__(self, cls: type) -> None:
        self.cls = cls

    def items(self) -> Any:
        return self.cls.__dict__.items()

    def get(self, key: str, default: Any = None) -> Any:
        return self.cls.__dict__.get(key, default)

    def __setitem__(self, key: str, value: Any) -> None:
        setattr(self.cls, key, value)


def _is_owner_slot(ns: Any, key: str, st: _TargetState) -> bool:
    """True for the slot the target lives in, or (inherited target) where it is defined."""
    if key != st.attr:
        return False
    if isinstance(ns, _ClassNamespace):
        if ns.cls is st.owner:
            return True
        # Patching Sub.method that Sub inherits must not rewrite Base.method.
        return isinstance(st.owner, type) and ns.cls in st.owner.__mro__
    return ns is getattr(st.owner, "__dict__", None)


class PatchManager:
    """Holds patches, applies and reverts them. One process-wide instance lives in portspeed.manager()."""

    def __init__(self) -> None:
        self._records: dict[str, PatchRecord] = {}
        self._targets: dict[str, _TargetState] = {}
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
                        d["unrebindable"] = self._unrebindable(st)
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
        self._check_versions(seen)
        return by_module

    def _check_versions(self, seen: dict[str, GateVersion]) -> None:
        """Say once when imported code shadows the installed release, and when a release is untested.

        A version outside ``versions.SUPPORTED`` is one no patch was checked against: the patches
        whose ranges admit it still apply (most releases keep most targets), with one warning
        naming the supported range; under PORTSPEED_STRICT=1 it is an error.
        """
        from packaging.specifiers import SpecifierSet

        for dist, gv in seen.items():
            if gv.version is None:
                continue
            key = f"{dist}=={gv.version}@{gv.source}"
            if gv.shadowed and key + ":shadow" not in self._said:
                self._said.add(key + ":shadow")
                log.warning("portspeed: %s", gv.describe(dist))
            supported = SUPPORTED.get(dist)
            if supported is None or gv.version in SpecifierSet(supported, prereleases=True):
                continue
            message = (f"{gv.describe(dist)} is outside the range portspeed's patches were checked against "
                       f"({dist} {supported})")
            if config.settings().strict:
                raise PatchStrictError(
                    f"PORTSPEED_STRICT=1 and {message}. Install a {dist} in {supported!r}, or unset "
                    f"PORTSPEED_STRICT to run with the patches whose ranges admit it "
                    f"(`portspeed patches --check {gv.version}` lists the targets that changed).")
            if key not in self._said:
                self._said.add(key)
                log.warning("portspeed: %s; the patches whose ranges admit it are applied untested. "
                            "`portspeed patches --check %s` lists targets that moved or changed; "
                            "PORTSPEED_STRICT=1 makes this an error.", message, gv.version)

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
            if st is not None and st.installed_value is _MISSING:
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
                owner, attr = _resolve(module, p.attr_path)
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
            if st is None or (st.installed_value is _MISSING and p.target not in targets):
                # not installed now: (re)read the original, the module may have been reloaded
                raw, own = _raw(owner, attr)
                self._targets[p.target] = _TargetState(
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

    def _compose(self, st: _TargetState, records: list[PatchRecord]) -> tuple[Any, tuple[str, ...]]:
        raw = st.original_raw
        base: Any = raw
        chain = [f"original {st.target}"]
        for r in records:
            p = r.patch
            if p.kind == REPLACE:
                impl = p.impl
                if isinstance(raw, staticmethod) and not isinstance(impl, staticmethod):
                    impl = staticmethod(impl)
                elif isinstance(raw, classmethod) and not isinstance(impl, classmethod):
                    impl = classmethod(impl)
                base = impl
                chain = [f"replacement {p.name}"]
            elif p.style == "function":
                inner = base
                base = p.impl(inner)
                if not callable(base):
                    raise TypeError(f"the factory of {p.name} returned {type(base).__name__}, not a callable")
                if getattr(base, "__wrapped__", None) is not inner:  # the chain walk (report, revert) follows it
                    base = functools.wraps(inner)(base)
                chain.append(f"wrapper {p.name} (order {p.order}, plain function)")
            else:
                import wrapt

                base = wrapt.FunctionWrapper(base, p.impl)
                chain.append(f"wrapper {p.name} (order {p.order})")
        return base, tuple(chain)

    def _install_many(self, targets: list[str], full_sweep: bool, since: str | None = None) -> None:
        """Install several targets, then rebind stale references in one sweep; all or nothing under strict."""
        live = self._live_by_target(targets)
        drop = [t for t in targets if not live[t]]
        done: list[tuple[_TargetState, Any, Any, tuple[str, ...], list[PatchRecord]]] = []
        failed: list[PatchRecord] = []
        replaced: dict[int, tuple[Any, _TargetState]] = {}
        for target in targets:
            records = live[target]
            if not records:
                continue
            st = self._targets[target]
            snapshot = (st, st.installed_raw, st.installed_value, st.chain, records)
            try:
                new_raw, chain = self._compose(st, records)
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
                if old is not _MISSING and old is not None and old is not new_value:  # None: an empty slot, not a stale alias
                    replaced[id(old)] = (old, st)
        if failed and config.settings().strict:
            for st, old_raw, old_value, old_chain, _ in reversed(done):
                self._put_back(st, old_raw)
                st.installed_raw, st.installed_value, st.chain = old_raw, old_value, old_chain
            raise _StrictViolation(failed)
        if drop:
            self._uninstall_many(drop)
        if replaced:
            self._sweep(replaced, full_sweep=full_sweep, since=since)

    def _put_back(self, st: _TargetState, raw: Any) -> None:
        """Put ``raw`` (or the original when _MISSING) back on the owner."""
        if raw is not _MISSING:
            setattr(st.owner, st.attr, raw)
        elif st.had_own:
            setattr(st.owner, st.attr, st.original_raw)
        elif st.attr in vars(st.owner):
            delattr(st.owner, st.attr)

    def _uninstall_many(self, targets: list[str]) -> None:
        """Restore originals of ``targets`` and every alias of their installed chains, in one sweep."""
        restored: dict[int, tuple[Any, _TargetState]] = {}
        for target in targets:
            st = self._targets.get(target)
            if st is None or st.installed_value is _MISSING:
                continue
            installed = st.installed_value
            self._put_back(st, _MISSING)
            for ns, key, _label in st.rebound:
                if ns.get(key) is installed:
                    ns[key] = st.original_value
            st.rebound.clear()
            st.installed_raw = st.installed_value = _MISSING
            st.chain = ()
            restored[id(installed)] = (installed, st)
        if restored:
            # aliases taken after patching (`from x import f` once patched) go back too
            self._sweep(restored, full_sweep=True, since=None, restoring=True)

    def _sweep(self, replaced: dict[int, tuple[Any, _TargetState]], full_sweep: bool,
               since: str | None, restoring: bool = False) -> None:
        """Rebind every module/class attribute that holds a replaced object."""
        replaced = {k: v for k, v in replaced.items() if _rebindable(v[0])}
        if not replaced:
            return
        modules = list(sys.modules.values())
        if not full_sweep and since is not None and since in sys.modules:
            # A module's own objects can only be bound by itself and by what it imported
            # while running (later in sys.modules); modules that import it later bind after
            # this hook ran, so they get the patched objects already.
            if all(getattr(old, "__module__", since) == since for old, _ in replaced.values()):
                modules = modules[list(sys.modules).index(since):]
        ids = replaced.keys()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated attributes warn when touched
            hits = list(_namespaces(modules, ids))  # collect first: rebinding must not disturb the walk
            for ns, label in hits:
                for key, value in [(k, v) for k, v in ns.items() if id(v) in ids]:
                    old, st = replaced[id(value)]
                    if old is not value or _is_owner_slot(ns, key, st):
                        continue
                    new = st.original_value if restoring or st.installed_value is _MISSING else st.installed_value
                    try:
                        ns[key] = new
                    except TypeError:  # immutable C type (torch.ByteTensor...): nothing we could rebind
                        continue
                    if not restoring:
                        st.rebound.append((ns, key, f"{label}.{key}"))

    # ------------------------------------------------------------------ diagnostics
    def _unrebindable(self, st: _TargetState) -> list[str]:
        """References to the original that no attribute rebinding reaches (closures, defaults, containers)."""
        found: list[str] = []
        original = st.original_value
        ignore = {id(st), id(self._targets)} | {id(vars(s)) for s in self._targets.values()}
        ignore |= _chain_internals(st.installed_value, original)
        for ref in gc.get_referrers(original):
            if id(ref) in ignore or isinstance(ref, (types.FrameType, _TargetState)):
                continue
            if isinstance(ref, dict):
                if ref.get("__name__") and "__builtins__" in ref:
                    continue  # module namespace: rebound already, or portspeed's own on purpose
                if "__module__" in ref:
                    cls = next((t for t in gc.get_referrers(ref) if isinstance(t, type)
                                and any(x is ref for x in gc.get_referents(t))), None)
                    if cls is None or _swept_class(cls, st):
                        continue  # class namespace: rebound, or where the original is defined
                    found.append(f"class attribute of {cls.__module__}.{cls.__qualname__} "
                                 "(not a top-level class of a module)")
                    continue
                kw = _functions_with(ref, "__kwdefaults__")
                if kw:
                    found += [f"keyword default of {f}" for f in kw]
                else:
                    found.append(f"dict container holding {st.attr}")
            elif isinstance(ref, types.CellType):
                users = [f for t in gc.get_referrers(ref) if isinstance(t, tuple)
                         for f in _functions_with(t, "__closure__")]
                found.append(f"closure cell holding {st.attr}" + (f" (used by {', '.join(users)})" if users else ""))
            elif isinstance(ref, tuple):
                if any(isinstance(t, type) and (t.__mro__ is ref or t.__bases__ is ref)
                       for t in gc.get_referrers(ref)):
                    continue  # a class's bases: listed as a subclass below
                owners = _functions_with(ref, "__defaults__")
                if owners:
                    found += [f"default argument of {f}" for f in owners]
                else:
                    found.append(f"tuple container holding {st.attr}")
            elif isinstance(ref, (list, set)):
                found.append(f"{type(ref).__name__} container holding {st.attr}")
        if isinstance(original, type):
            found += [f"subclass {c.__module__}.{c.__qualname__} (bases cannot be rebound)"
                      for c in original.__subclasses__()]
        return found

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


def _chain_internals(installed: Any, original: Any) -> set[int]:
    """ids of the cells and __dict__s through which the installed chain itself holds the original."""
    ids: set[int] = set()
    obj, seen = installed, 0
    while obj is not _MISSING and obj is not original and seen < 64:
        if isinstance(obj, types.FunctionType):
            ids.add(id(obj.__dict__))
            ids.update(id(c) for c in obj.__closure__ or ())
        obj, seen = getattr(obj, "__wrapped__", _MISSING), seen + 1
    return ids


def _swept_class(cls: type, st: _TargetState) -> bool:
    """Whether the sweep reaches ``cls`` (a top-level class of its module) or it defines the target."""
    if isinstance(st.owner, type) and cls in st.owner.__mro__:
        return True
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    return module is not None and vars(module).get(cls.__name__) is cls


def _functions_with(obj: Any, attr: str) -> list[str]:
    """Names of the functions whose ``attr`` (``__defaults__``, ``__closure__``...) is ``obj``."""
    return [f"{f.__module__}.{f.__qualname__}" for f in gc.get_referrers(obj)
            if isinstance(f, types.FunctionType) and getattr(f, attr, None) is obj]


def _conflict(first: Patch, second: Patch) -> PatchConflictError:
    return PatchConflictError(
        f"patches {first.name!r} and {second.name!r} both replace {first.target}; only one replacement "
        "per target is allowed: make one of them a wrapper, or disable one with PORTSPEED_DISABLE"
    )
