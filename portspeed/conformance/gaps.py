"""What the collective library lacks, said as the ``BackendGaps`` declaration to write.

Why: an undeclared gap used to surface as the backend's own error from deep inside a rank, and a
vendor had to work out which ``BackendGaps`` field that meant. Two sources answer it here:

- the routed checks (always): every collective x op x dtype runs through the router with the
  adapter's table (``collectives``); each call that raises or gives a wrong value carries its key
  ``(collective, op, dtype)``. ``suggest`` turns the failing keys into declaration items (a
  collective that fails for everything -> ``unsupported_collectives``, a dtype that fails for every
  op -> ``unsupported_dtypes`` or, silently wrong, ``wrong_dtypes``, an op -> ``unsupported_ops``,
  an output that must be chunk-shaped -> ``chunk_shaped_all_gather``), each printed as the field to
  write with what is declared already, and the whole declaration that fits, ready to paste;
- the raw backend (``--declared-gaps``, patches off; ``raw_declared``): each item of the table is
  run raw. A built-in row (Gloo) must still raise or go wrong; a declared item none of whose calls
  raise or go wrong is one the library does not have: the declaration can go.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["Finding", "declaration", "raw_declared", "suggest"]

#: the key op of an all_gather_into_tensor output NCCL takes by element count (flat, stacked, 0-d)
SHAPE = "shape"


@dataclasses.dataclass
class Finding:
    """One item the declaration lacks: its field, its value, and the calls that showed it."""

    field: str
    value: Any
    what: str  # e.g. "reduce_scatter_tensor bfloat16: every op raised"
    evidence: str  # the first failing check and its detail


def _dtype(name: str) -> Any:
    import torch

    return getattr(torch, name)


def _effect(outcomes: list[str]) -> str:
    return "raised" if "raises" in outcomes else "was silently wrong"


def suggest(results: list[dict[str, Any]], declared: Any) -> tuple[list[Finding], set[tuple], dict[tuple, str]]:
    """``(findings, keys they explain, why the other failing keys cannot be declared)`` from the routed checks of
    every rank (``results`` with ``key``, ``ok``, ``effect``, ``flagged``); ``declared``: the adapter's
    ``BackendGaps`` or None. Not declarable: a collective the router cannot rewrite (broadcast, gather...), and a
    call the table already rewrites."""
    import torch.distributed as dist

    from portspeed.accelerator.backend_gaps import DECLARABLE

    outcomes: dict[tuple, list[str]] = {}
    first: dict[tuple, str] = {}
    flagged: dict[tuple, bool] = {}
    for r in results:
        if not r.get("key"):
            continue
        key = tuple(r["key"])
        outcomes.setdefault(key, [])
        flagged[key] = flagged.get(key, False) or bool(r.get("flagged"))
        if not r["ok"]:
            outcomes[key].append(r.get("effect", "wrong"))
            first.setdefault(key, f"{r['check']}: {r['detail']}")
    failed = {k for k, v in outcomes.items() if v}
    findings: list[Finding] = []
    explained: set[tuple] = set()
    ops = set(declared.unsupported_ops if declared else ())
    have = {f: set(getattr(declared, f)) if declared else set() for f in
            ("unsupported_dtypes", "unsupported_collectives", "wrong_dtypes")}

    shape = sorted(k for k in failed if k[0] == "all_gather_into_tensor" and k[1] == SHAPE)
    if shape and not (declared and declared.chunk_shaped_all_gather):
        findings.append(Finding("chunk_shaped_all_gather", True, "all_gather_into_tensor with a flat, stacked or 0-d "
                                f"output {_effect([e for k in shape for e in outcomes[k]])}", first[shape[0]]))
        explained.update(shape)
    for coll in DECLARABLE:
        keys = [k for k in outcomes if k[0] == coll]
        bad = [k for k in keys if k in failed]
        if not bad:
            continue
        if len(bad) == len(keys) and all("raises" in outcomes[k] for k in bad):
            if coll not in have["unsupported_collectives"]:
                findings.append(Finding("unsupported_collectives", coll, f"{coll}: every op and dtype raised",
                                        first[bad[0]]))
            explained.update(bad)
            continue
        for dt in sorted({k[2] for k in bad}):
            of_dtype = [k for k in keys if k[2] == dt]
            if all(k in failed for k in of_dtype):
                seen = [e for k in of_dtype for e in outcomes[k]]
                field = "unsupported_dtypes" if "raises" in seen else "wrong_dtypes"
                if (coll, _dtype(dt)) not in have[field]:
                    findings.append(Finding(field, (coll, _dtype(dt)), f"{coll} {dt}: every op {_effect(seen)}",
                                            first[of_dtype[0]]))
                explained.update(of_dtype)
        for k in bad:
            if k not in explained and k[1] is not None and not flagged[k]:
                op = getattr(dist.ReduceOp, k[1])
                if op not in ops:
                    findings.append(Finding("unsupported_ops", op, f"{k[1]} ({coll} {k[2]} {_effect(outcomes[k])})",
                                            first[k]))
                    ops.add(op)
                explained.add(k)
    found_ops = {f.value.name for f in findings if f.field == "unsupported_ops"}
    # a call the table rewrites (another dtype) that fails for an op found missing above: the same gap
    explained.update(k for k in failed if k[1] in found_ops)
    why = {k: (f"the router cannot rewrite {k[0]}: the library must do it right" if k[0] not in DECLARABLE
               and k[0] != "all_gather_into_tensor" else "the table already rewrites this call: a second gap, or a "
               "portspeed bug" if flagged[k] else "no BackendGaps field describes it")
           for k in failed - explained}
    return findings, explained, why


def declaration(declared: Any, findings: list[Finding], drop: list[tuple[str, Any]] = ()) -> Any:
    """``declared`` (a BackendGaps, or None) with the findings added and the ``drop`` items ``(field, value)``
    taken out: the declaration that fits the library."""
    from portspeed.accelerator.backend_gaps import BackendGaps

    base = declared or BackendGaps(note="what portspeed conformance found")
    changes: dict[str, Any] = {}
    for f in findings:
        if f.field == "chunk_shaped_all_gather":
            changes[f.field] = True
        else:
            changes[f.field] = tuple(changes.get(f.field, getattr(base, f.field))) + (f.value,)
    for field, value in drop:
        if field == "chunk_shaped_all_gather":
            changes[field] = False
        else:
            changes[field] = tuple(v for v in changes.get(field, getattr(base, field)) if v != value)
    return dataclasses.replace(base, **changes)


def raw_declared(r: Any, caps: Any, declared: Any) -> None:
    """Patches off: each row of the table, run raw. A built-in row must still raise or go wrong; a declared
    item is confirmed when one of its calls does, else its declaration can go (``r.results`` gets the checks)."""
    from portspeed.accelerator.capabilities import BITWISE_OPS, CHUNK_SHAPED

    items = declared.items() if declared is not None else []
    owner = {(g.collective, g.op, g.dtype): i for i, (_, _, rows) in enumerate(items) for g in rows}
    seen: dict[int, list[str]] = {}
    for gap in caps.gaps:
        did = _run_raw(r, gap)
        what = "flat output" if gap.collective == CHUNK_SHAPED else gap.op.name if gap.op else "SUM"
        dtype = str(gap.dtype or ("torch.int64" if gap.op in BITWISE_OPS else "torch.float32"))[6:]
        name = f"raw {gap.collective} {what} {dtype}"
        item = owner.get((gap.collective, gap.op, gap.dtype))
        if item is not None:
            seen.setdefault(item, []).append(f"{name} {did}")
            continue
        ok = (did == "raised") if gap.effect == "raises" else did != "did it right"
        r.results.append({"check": f"{name} -> {gap.effect}", "ok": ok,
                          "detail": "" if ok else f"the built-in table flags it, but the backend {did}"})
    for i, (field, _, _) in enumerate(items):
        calls = seen.get(i, [])
        needed = any(c.endswith((" raised", " was wrong")) for c in calls) or all(
            c.endswith(" off the root") for c in calls)
        source = _item_source(declared, field, items[i][1])
        r.results.append({"check": f"raw declared {source}: the raw backend shows it",
                          "ok": needed, "item": i, "detail": "" if needed else "the declaration can go (each declared "
                          f"gap costs a rewrite): {'; '.join(calls)}"})


def _item_source(declared: Any, field: str, value: Any) -> str:
    """One declared item as the adapter writes it, e.g. ``unsupported_ops=[dist.ReduceOp.AVG]``."""
    one = dataclasses.replace(declared, **{f: () for f in ("unsupported_ops", "unsupported_dtypes",
                                                           "unsupported_collectives", "wrong_dtypes")},
                              chunk_shaped_all_gather=False)
    one = dataclasses.replace(one, **{field: True if field == "chunk_shaped_all_gather" else (value,)})
    return one.field_source(field)


def _run_raw(r: Any, gap: Any) -> str:
    """One call of ``gap`` on the raw backend: 'raised', 'was wrong', 'did it right' (or, a reduce off its root,
    'cannot be seen off the root')."""
    import torch
    import torch.distributed as dist

    from portspeed.conformance.reference import reference as ref

    from portspeed.accelerator.capabilities import BITWISE_OPS

    R, n, rank = dist.ReduceOp, r.n, r.rank
    op = gap.op if gap.op is not None else R.SUM
    dtype = gap.dtype or (torch.int64 if op in BITWISE_OPS else torch.float32)  # bitwise ops need integers
    op_arg = dist._make_nccl_premul_sum(0.5) if op == R.PREMUL_SUM else op
    x = r.data(rank, (n * 2,), dtype)
    out, want = None, None
    try:
        if gap.collective == "all_reduce":
            dist.all_reduce(x, op=op_arg)
            out, want = x, ref(op.name, r.everyone((n * 2,)), dtype)
        elif gap.collective == "reduce":
            dist.reduce(x, dst=0, op=op_arg)
            if rank != 0:
                return "cannot be seen off the root"
            out, want = x, ref(op.name, r.everyone((n * 2,)), dtype)
        elif gap.collective in ("reduce_scatter_tensor", "reduce_scatter"):
            out = r.empty(2, dtype)
            if gap.collective == "reduce_scatter_tensor":
                dist.reduce_scatter_tensor(out, x, op=op_arg)
            else:
                dist.reduce_scatter(out, list(x.chunk(n)), op=op_arg)
            want = ref(op.name, r.everyone((n * 2,)), dtype)[rank * 2:rank * 2 + 2]
        elif gap.collective == "all_to_all":
            outs = [r.empty(2, dtype) for _ in range(n)]
            dist.all_to_all(outs, list(x.chunk(n)))
        elif gap.collective == "all_gather_into_tensor":  # the shape gap: a flat output of a 2-d input
            out = r.empty(n * 6, dtype)
            dist.all_gather_into_tensor(out, r.data(rank, (2, 3), dtype))
            want = r.everyone((2, 3)).to(dtype).reshape(-1)
    except (RuntimeError, ValueError, NotImplementedError):
        return "raised"
    if out is not None and want is not None and not torch.equal(out.cpu(), want):
        return "was wrong"
    return "did it right"
