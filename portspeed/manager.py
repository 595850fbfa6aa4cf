"""The patch manager: applies declared Patch records, lazily, composably, reversibly.

Contract
- ``register`` validates and stores patches; two replacements of one target raise
  PatchConflictError naming both, a second patch with the same name but other content
  raises, re-registering an identical patch is a no-op.
- ``apply`` gates each patch (PORTSPEED_DISABLE, distribution version range, condition on
  the accelerator), then installs it: at once when its module is already imported, else
  from a post-import hook (wrapt) when the module is first imported. Applying twice
  changes nothing.
- Installing a target composes its chain: the replacement (or the original), then the
  wrappers by (order, registration). Names bound to the original or to a previous chain
  elsewhere (``from x import f``, ``import x as y``, class attributes) are rebound and
  recorded; revert restores them by identity.
- ``revert`` restores every original object; ``scoped`` applies a set of patches inside a
  ``with`` block only.
- Skips (target missing, version out of range) and failures are recorded with reasons;
  with PORTSPEED_STRICT=1 they raise PatchStrictError at apply time.

Limits: references held in closures, default arguments and containers cannot be rebound;
``report(deep=True)`` lists them (it walks the garbage collector's referrers, so it is
not done on the hot path). Modules under ``portspeed`` are never rebound: patches keep
references to originals on purpose.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import logging
import sys
import threading
import types
import warnings
from typing import Any, Iterable, Iterator

import wrapt

from . import config
from .errors import PatchConflictError, PatchDefinitionError, PatchStrictError
from .patch import REPLACE, WRAP, Patch
from .versions import distribution_version

__all__ = ["PatchManager", "PatchRecord", "STATUSES"]

log = logging.getLogger("portspeed.patches")

#: Every status a patch can be in, as shown by the report.
STATUSES = ("registered", "pending", "applied", "skipped", "inactive", "disabled", "failed", "reverted")

_NO_REBIND_PREFIXES = ("portspeed", "wrapt", "importlib", "_frozen_importlib")
_MISSING = object()


@dataclasses.dataclass
class PatchRecord:
    """What happened to one patch; the report is a list of these."""

    patch: Patch
    seq: int
    status: str = "registered"
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
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
    installed_value: Any = _MISSING
    chain: tuple[str, ...] = ()
    rebound: list[tuple[Any, str, str]] = dataclasses.field(default_factory=list)


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


def _namespaces(modules: Iterable[types.ModuleType]) -> Iterator[tuple[Any, str]]:
    """Module dicts and handles on the classes defined in them, each with a label."""
    for mod in modules:
        name = getattr(mod, "__name__", None)
        if not isinstance(name, str) or name.startswith(_NO_REBIND_PREFIXES):
            continue
        ns = getattr(mod, "__dict__", None)
        if not isinstance(ns, dict):
            continue
        yield ns, name
        for value in list(ns.values()):
            if isinstance(value, type) and getattr(value, "__module__", None) == name:
                yield _ClassNamespace(value), f"{name}.{value.__qualname__}"


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


def _is_owner_slot(ns: Any, key: str, st: "_TargetState") -> bool:
    if key != st.attr:
        return False
    if isinstance(ns, _ClassNamespace):
        return ns.cls is st.owner
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

    # ------------------------------------------------------------------ register
    def register(self, patches: Iterable[Patch]) -> None:
        """Add patches. Validates names and replacement conflicts before storing any."""
        patches = list(patches)
        with self._lock:
            new: list[Patch] = []
            names: dict[str, Patch] = {}
            for p in patches:
                if not isinstance(p, Patch):
                    raise PatchDefinitionError(f"register() takes Patch records, got {type(p).__name__}")
                known = self._records.get(p.name) or names.get(p.name)
                if known is not None:
                    other = known.patch if isinstance(known, PatchRecord) else known
                    if other == p:
                        continue
                    raise PatchConflictError(
                        f"two different patches are named {p.name!r} (targets {other.target} and {p.target}); "
                        "patch names must be unique"
                    )
                names[p.name] = p
                new.append(p)
            replacements = {r.patch.target: r.patch for r in self._records.values()
                            if r.patch.kind == REPLACE and r.status != "reverted"}
            for p in new:
                if p.kind == REPLACE:
                    other = replacements.get(p.target)
                    if other is not None:
                        raise PatchConflictError(
                            f"patches {other.name!r} and {p.name!r} both replace {p.target}; "
                            "only one replacement per target is allowed: make one of them a wrapper, "
                            "or disable one with PORTSPEED_DISABLE"
                        )
                    replacements[p.target] = p
            for p in new:
                self._seq += 1
                self._records[p.name] = PatchRecord(p, self._seq)
            if self._active and new:
                self._activate([self._records[p.name] for p in new])

    # ------------------------------------------------------------------ apply / revert
    def apply(self) -> None:
        """Gate and install every registered patch; idempotent."""
        with self._lock:
            self._active = True
            todo = [r for r in self._records.values() if r.status in ("registered", "reverted")]
            self._activate(todo)

    def revert(self) -> None:
        """Restore every original object (rebound aliases included) and forget pending hooks."""
        with self._lock:
            self._active = False
            self._generation += 1
            for target in reversed(list(self._targets)):
                self._uninstall(target)
            for r in self._records.values():
                if r.status in ("applied", "pending", "failed", "skipped", "inactive", "disabled"):
                    r.status, r.detail = "reverted", ""

    @contextlib.contextmanager
    def scoped(self, patches: Iterable[Patch]) -> Iterator["PatchManager"]:
        """Register and apply ``patches`` for the ``with`` block; remove them after."""
        patches = list(patches)
        with self._lock:
            was_active = self._active
            self.register(patches)
            if not was_active:
                self._active = True
                self._activate([self._records[p.name] for p in patches])
        try:
            yield self
        finally:
            with self._lock:
                touched = {p.target for p in patches}
                for p in patches:
                    self._records.pop(p.name, None)
                for target in touched:
                    if target in self._targets:
                        self._install(target)
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

    def records(self) -> list[PatchRecord]:
        return sorted(self._records.values(), key=lambda r: r.seq)

    # ------------------------------------------------------------------ internals
    def _activate(self, records: list[PatchRecord]) -> None:
        settings = config.settings()
        accelerator = None
        by_module: dict[str, list[PatchRecord]] = {}
        for r in records:
            p = r.patch
            if settings.is_disabled(p.name):
                r.status, r.detail = "disabled", "blocked by PORTSPEED_DISABLE"
                continue
            if p.distribution:
                version = distribution_version(p.distribution)
                if version is None:
                    r.status, r.detail = "skipped", f"distribution {p.distribution!r} is not installed"
                    self._strict(r)
                    continue
                if p.versions and version not in p.specifier:
                    r.status = "skipped"
                    r.detail = (f"{p.distribution} {version} is outside the range {p.versions!r} this patch "
                                "is written for; check `portspeed info` for the supported versions")
                    self._strict(r)
                    continue
            if p.when is not None:
                if accelerator is None:
                    from .accelerator import get_accelerator

                    accelerator = get_accelerator()
                try:
                    ok = bool(p.when(accelerator))
                except Exception as exc:  # a broken condition is a failed patch, not a silent skip
                    r.status, r.detail = "failed", f"condition raised {type(exc).__name__}: {exc}"
                    self._strict(r)
                    continue
                if not ok:
                    r.status = "inactive"
                    r.detail = f"condition false for accelerator {accelerator.name!r}"
                    continue
            r.status, r.detail = "pending", f"waiting for `import {p.module}`"
            by_module.setdefault(p.module, []).append(r)

        ready = [m for m in by_module if m in sys.modules]
        if ready:
            targets = []
            for m in ready:
                targets += self._resolve_records(sys.modules[m], by_module[m])
            self._install_many(targets, full_sweep=True)
        for m in by_module:
            if m not in sys.modules:
                self._hook(m)

    def _hook(self, module_name: str) -> None:
        if module_name in self._hooked_modules:
            return
        self._hooked_modules.add(module_name)
        generation = self._generation

        def on_import(module: types.ModuleType) -> None:
            with self._lock:
                if not self._active or self._generation != generation:
                    self._hooked_modules.discard(module_name)
                    if self._active:  # reverted then re-applied: a fresh hook took over
                        return
                    return
                pending = [r for r in self._records.values()
                           if r.status == "pending" and r.patch.module == module_name]
                targets = self._resolve_records(module, pending)
                self._install_many(targets, full_sweep=False, since=module_name)

        wrapt.register_post_import_hook(on_import, module_name)

    def _resolve_records(self, module: types.ModuleType, records: list[PatchRecord]) -> list[str]:
        targets: list[str] = []
        for r in records:
            p = r.patch
            try:
                owner, attr = _resolve(module, p.attr_path)
            except AttributeError as exc:
                version = distribution_version(p.distribution) if p.distribution else None
                where = f" ({p.distribution} {version})" if version else ""
                r.status = "skipped"
                r.detail = (f"target {p.target} not found{where}: {exc}; the upstream code moved, "
                            "so this patch needs updating for this version")
                self._strict(r)
                continue
            if p.target not in self._targets:
                raw, own = _raw(owner, attr)
                self._targets[p.target] = _TargetState(
                    target=p.target, owner=owner, attr=attr, had_own=own,
                    original_raw=raw, original_value=getattr(owner, attr))
            if p.target not in targets:
                targets.append(p.target)
        return targets

    def _active_patches(self, target: str) -> list[PatchRecord]:
        rs = [r for r in self._records.values()
              if r.patch.target == target and r.status in ("pending", "applied")]
        return sorted(rs, key=lambda r: (r.patch.kind != REPLACE, r.patch.order, r.seq))

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
            else:
                base = wrapt.FunctionWrapper(base, p.impl)
                chain.append(f"wrapper {p.name}")
        return base, tuple(chain)

    def _install_many(self, targets: list[str], full_sweep: bool, since: str | None = None) -> None:
        """Install several targets, then rebind stale references in one sweep."""
        replaced: dict[int, tuple[Any, _TargetState]] = {}
        for target in targets:
            if not self._active_patches(target):
                self._uninstall(target)
                continue
            result = self._set(target)
            if result is not None:
                for old in result[0]:
                    replaced[id(old)] = (old, result[1])
        if replaced:
            self._sweep(replaced, full_sweep=full_sweep, since=since)

    def _install(self, target: str) -> None:
        self._install_many([target], full_sweep=True)

    def _set(self, target: str) -> tuple[list[Any], _TargetState] | None:
        """Put the composed chain on the owner; return the objects whose aliases must be rebound."""
        st = self._targets[target]
        records = self._active_patches(target)
        previous = st.installed_value
        try:
            new_raw, chain = self._compose(st, records)
            setattr(st.owner, st.attr, new_raw)
            new_value = getattr(st.owner, st.attr)
        except Exception as exc:
            for r in records:
                r.status = "failed"
                r.detail = f"installing on {target} raised {type(exc).__name__}: {exc}"
                self._strict(r)
            return None
        for r in records:
            r.status, r.detail = "applied", ""
        st.chain = chain
        olds = [st.original_value]
        if previous is not _MISSING and previous is not st.original_value:
            olds.append(previous)
        st.installed_value = new_value
        return [o for o in olds if o is not new_value], st

    def _uninstall(self, target: str) -> None:
        st = self._targets.get(target)
        if st is None or st.installed_value is _MISSING:
            return
        installed = st.installed_value
        if st.had_own:
            setattr(st.owner, st.attr, st.original_raw)
        elif st.attr in vars(st.owner):
            delattr(st.owner, st.attr)
        for ns, key, _label in st.rebound:
            if ns.get(key) is installed:
                ns[key] = st.original_value
        st.rebound.clear()
        st.installed_value = _MISSING
        st.chain = ()
        # aliases taken after patching (from x import f, once patched) go back too
        self._sweep({id(installed): (installed, st)}, full_sweep=True, since=None, restoring=True)

    def _sweep(self, replaced: dict[int, tuple[Any, _TargetState]], full_sweep: bool,
               since: str | None, restoring: bool = False) -> None:
        """Rebind every module/class attribute that holds a replaced object."""
        modules = list(sys.modules.values())
        if not full_sweep and since is not None:
            names = list(sys.modules)
            try:
                start = names.index(since)
                defined_here = all(
                    getattr(old, "__module__", since) == since for old, _ in replaced.values())
                if defined_here:
                    modules = [sys.modules[n] for n in names[start:]]
            except ValueError:
                pass
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecated attributes warn when touched
            self._sweep_namespaces(modules, replaced, restoring)

    def _sweep_namespaces(self, modules: list, replaced: dict[int, tuple[Any, _TargetState]],
                          restoring: bool) -> None:
        for ns, label in _namespaces(modules):
            for key, value in list(ns.items()):
                hit = replaced.get(id(value))
                if hit is None or hit[0] is not value:
                    continue
                old, st = hit
                if _is_owner_slot(ns, key, st):
                    continue
                new = st.original_value if restoring else st.installed_value
                if new is _MISSING:
                    new = st.original_value
                ns[key] = new
                if not restoring:
                    st.rebound.append((ns, key, f"{label}.{key}"))

    def _unrebindable(self, st: _TargetState) -> list[str]:
        """References to the original that no attribute rebinding reaches (closures, defaults, containers)."""
        found: list[str] = []
        original = st.original_value
        ignore = {id(st), id(st.__dict__), id(self._targets)}
        for ref in gc.get_referrers(original):
            if id(ref) in ignore or isinstance(ref, (types.FrameType, _TargetState)):
                continue
            if isinstance(ref, dict):
                if ref.get("__name__") and "__builtins__" in ref:
                    continue  # module namespace: handled by rebinding (or the owner itself)
                if "__module__" in ref or "__qualname__" in ref:
                    continue  # class namespace
                found.append(f"dict container holding {st.attr}")
            elif isinstance(ref, types.CellType):
                found.append(f"closure cell holding {st.attr}")
            elif isinstance(ref, tuple):
                owners = [f for f in gc.get_referrers(ref) if isinstance(f, types.FunctionType)
                          and f.__defaults__ is ref]
                if owners:
                    found += [f"default argument of {f.__module__}.{f.__qualname__}" for f in owners]
                else:
                    found.append(f"tuple container holding {st.attr}")
            elif isinstance(ref, (list, set)):
                found.append(f"{type(ref).__name__} container holding {st.attr}")
            elif isinstance(ref, type):
                pass
        if isinstance(original, type):
            found += [f"subclass {c.__module__}.{c.__qualname__} (bases cannot be rebound)"
                      for c in original.__subclasses__()]
        return found

    def _strict(self, r: PatchRecord) -> None:
        if r.status in ("skipped", "failed"):
            log.warning("portspeed patch %s %s: %s", r.patch.name, r.status, r.detail)
            if config.settings().strict:
                raise PatchStrictError(
                    f"PORTSPEED_STRICT=1 and patch {r.patch.name!r} ({r.patch.target}) {r.status}: {r.detail}. "
                    "Unset PORTSPEED_STRICT to continue without it, or PORTSPEED_DISABLE it on purpose."
                )
