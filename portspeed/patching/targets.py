"""Patch targets: find the object a ``"pkg.mod:Qual.attr"`` names, remember what was there, put it back.

A target is resolved when its module is imported; ``TargetState`` keeps the original (the raw
descriptor and the value seen through getattr), what is installed now, the chain of patches
composing it, and every alias the rebinding sweep rewrote, so ``revert()`` restores all of it.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

__all__ = ["MISSING", "TargetState", "put_back", "raw_attribute", "resolve_target"]

#: "nothing installed" (None is a legitimate attribute value)
MISSING = object()


@dataclasses.dataclass
class TargetState:
    """Bookkeeping for one patched attribute."""

    target: str
    owner: Any
    attr: str
    had_own: bool  # the attribute lived in vars(owner), not inherited
    original_raw: Any  # what vars(owner)[attr] held (descriptor included)
    original_value: Any  # what getattr(owner, attr) returned
    installed_raw: Any = MISSING
    installed_value: Any = MISSING
    chain: tuple[str, ...] = ()
    rebound: list[tuple[Any, str, str]] = dataclasses.field(default_factory=list)


def resolve_target(module: types.ModuleType, path: tuple[str, ...]) -> tuple[Any, str]:
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


def raw_attribute(owner: Any, attr: str) -> tuple[Any, bool]:
    """The raw attribute (descriptors unbound) and whether it is the owner's own."""
    if isinstance(owner, type):
        if attr in vars(owner):
            return vars(owner)[attr], True
        for klass in owner.__mro__[1:]:
            if attr in vars(klass):
                return vars(klass)[attr], False
    return getattr(owner, attr), True


def put_back(st: TargetState, raw: Any) -> None:
    """Put ``raw`` (or the original when MISSING) back on the owner."""
    if raw is not MISSING:
        setattr(st.owner, st.attr, raw)
    elif st.had_own:
        setattr(st.owner, st.attr, st.original_raw)
    elif st.attr in vars(st.owner):
        delattr(st.owner, st.attr)
