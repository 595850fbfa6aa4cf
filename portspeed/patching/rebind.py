"""The identity sweep: rebind every alias of a replaced object, and find the references it cannot reach.

``from megatron.core.utils import f`` copies ``f`` into the importer's namespace; patching the
attribute at its source would leave that copy stale. After an install (and a revert) the
manager hands the replaced objects to ``sweep``, which walks module dicts and the classes
defined in them and rewrites every slot holding one. ``unrebindable`` (``report(deep=True)``)
lists what no attribute rewrite reaches: closures, defaults, containers, subclasses.
"""

from __future__ import annotations

import gc
import sys
import types
import warnings
from typing import Any, Iterable, Iterator

from portspeed.patching.targets import MISSING, TargetState

__all__ = ["sweep", "unrebindable"]

#: Top-level packages whose namespaces are never rebound (by package, not by name prefix:
#: a user module called ``portspeed_tools`` is rebound like any other).
_NO_REBIND_PACKAGES = frozenset({"portspeed", "wrapt", "importlib", "_frozen_importlib",
                                 "_frozen_importlib_external"})


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


def _is_owner_slot(ns: Any, key: str, st: TargetState) -> bool:
    """True for the slot the target lives in, or (inherited target) where it is defined."""
    if key != st.attr:
        return False
    if isinstance(ns, _ClassNamespace):
        if ns.cls is st.owner:
            return True
        # Patching Sub.method that Sub inherits must not rewrite Base.method.
        return isinstance(st.owner, type) and ns.cls in st.owner.__mro__
    return ns is getattr(st.owner, "__dict__", None)


def sweep(replaced: dict[int, tuple[Any, TargetState]], full_sweep: bool,
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
                new = st.original_value if restoring or st.installed_value is MISSING else st.installed_value
                try:
                    ns[key] = new
                except TypeError:  # immutable C type (torch.ByteTensor...): nothing we could rebind
                    continue
                if not restoring:
                    st.rebound.append((ns, key, f"{label}.{key}"))


def unrebindable(st: TargetState, targets: dict[str, TargetState]) -> list[str]:
    """References to the original that no attribute rebinding reaches (closures, defaults, containers)."""
    found: list[str] = []
    original = st.original_value
    ignore = {id(st), id(targets)} | {id(vars(s)) for s in targets.values()}
    ignore |= _chain_internals(st.installed_value, original)
    for ref in gc.get_referrers(original):
        if id(ref) in ignore or isinstance(ref, (types.FrameType, TargetState)):
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


def _chain_internals(installed: Any, original: Any) -> set[int]:
    """ids of the cells and __dict__s through which the installed chain itself holds the original."""
    ids: set[int] = set()
    obj, seen = installed, 0
    while obj is not MISSING and obj is not original and seen < 64:
        if isinstance(obj, types.FunctionType):
            ids.add(id(obj.__dict__))
            ids.update(id(c) for c in obj.__closure__ or ())
        obj, seen = getattr(obj, "__wrapped__", MISSING), seen + 1
    return ids


def _swept_class(cls: type, st: TargetState) -> bool:
    """Whether the sweep reaches ``cls`` (a top-level class of its module) or it defines the target."""
    if isinstance(st.owner, type) and cls in st.owner.__mro__:
        return True
    module = sys.modules.get(getattr(cls, "__module__", None) or "")
    return module is not None and vars(module).get(cls.__name__) is cls


def _functions_with(obj: Any, attr: str) -> list[str]:
    """Names of the functions whose ``attr`` (``__defaults__``, ``__closure__``...) is ``obj``."""
    return [f"{f.__module__}.{f.__qualname__}" for f in gc.get_referrers(obj)
            if isinstance(f, types.FunctionType) and getattr(f, attr, None) is obj]


