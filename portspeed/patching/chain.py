"""Composition: the object installed on a target, built from its original and its live patches in order.

A replacement (at most one per target) takes the original's place; wrappers stack on top by
``order`` then registration order, each either a ``wrapt.FunctionWrapper`` or (``style="function"``)
a plain function from the patch's factory. The chain's labels are what the report shows.
"""

from __future__ import annotations

import functools
from typing import Any

from portspeed.patching.record import REPLACE
from portspeed.patching.status import PatchRecord
from portspeed.patching.targets import TargetState

__all__ = ["compose"]


def compose(st: TargetState, records: list[PatchRecord]) -> tuple[Any, tuple[str, ...]]:
    """(the object to install, the chain labels) for ``st`` with ``records`` (live, in chain order)."""
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
