"""What the collectives suite proposes for a library that is silently wrong or lacks a collective: staging.

Why: ``BackendGaps`` only describes what the router can rewrite (an op, a dtype, a missing list collective);
a CCL that hands back wrong values for a collective, or lacks one the router cannot rewrite (broadcast,
all_gather...), has no declaration that fixes it, except sending that collective through the host on Gloo
(``portspeed.comm.staged``). ``propose`` reads the routed checks of every rank and answers the line to paste:
``backend = "staged"`` when every collective checked was wrong or missing, else ``staged_collectives = (...)``
naming those (with what the adapter stages already), or None.
"""

from __future__ import annotations

from typing import Any

__all__ = ["propose"]

#: the checks' collective names that staged_collectives spells otherwise
_STAGE_NAME = {"batch_isend_irecv": "send_recv", "isend/recv": "send_recv"}


def propose(results: list[dict[str, Any]], acc: Any) -> tuple[str, str] | None:
    """``(attribute, value as Python source)`` to paste into ``acc``'s class, or None (nothing to stage).

    A collective is staged when one of its calls gave a wrong value without raising, or when every call of it
    raised (it is missing); a collective that only refuses some ops or dtypes is left to ``backend_gaps``.
    """
    from portspeed.accelerator.declarations import STAGEABLE, STAGED_BACKEND, groups_backend

    if groups_backend(acc) == STAGED_BACKEND and not acc.staged_collectives:
        return None  # everything is staged already: a wrong value here is portspeed's, not the library's
    failed: dict[str, list[str]] = {}
    passed: set[str] = set()
    for c in results:
        if not c.get("key"):
            continue
        name = _STAGE_NAME.get(c["key"][0], c["key"][0])
        if name not in STAGEABLE:
            continue
        if c["ok"]:
            passed.add(name)
        else:
            failed.setdefault(name, []).append(c.get("effect", "wrong"))
    stage = [n for n in STAGEABLE if n in failed and ("wrong" in failed[n] or n not in passed)]
    if not stage:
        return None
    if not passed - set(stage):
        return "backend", f'"{STAGED_BACKEND}"'
    return "staged_collectives", repr(tuple(dict.fromkeys(tuple(acc.staged_collectives) + tuple(stage))))
