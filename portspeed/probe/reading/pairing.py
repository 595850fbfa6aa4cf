"""A run's probe entries put on the reference's layout, exactly, or refused by name.

Why: a TP2 run's layer output is two halves, a DP2 run's micro-batch 1 is the one-rank run's
micro-batch 2, a PP2 run's layer 2 lives on another rank. Comparing them against a TP1 run needs
the halves joined and the calls matched, with no approximation that could hide a wrong shard.

Contract: `pair_dumps(ref, run)` checks that the two dumps describe one model (else
`ProbeInputError`, one line) and returns a `Pairing`: every compared tensor (`Slot`) with each
side's `Copy`s, and every tensor left out with its reason. Two kinds of pair:

* ``device``: identical layouts (device vs device). Each rank's tensor against the same rank's.
* ``layout``: different layouts. Per tensor, by its ``ps_layout``: ``split`` parts are combined
  exactly (max of maxes, min of mins, means weighted by element count, square root of summed
  squares, NaN/Inf counts summed); ``full`` copies stay one per rank and are compared rank by rank,
  never summed; ``partial`` and ``unknown`` tensors are refused by name (a side with no TP, CP or EP
  holds every tensor whole). Micro-batches are matched through the meta's ``dp_order``
  (``contiguous``: rank r's call j is r*m + j; ``single``: j*DP + r; ``cyclic`` / ``unknown``: only
  per-iteration entries compare); MoE experts by their global index, aggregated over the iteration
  (whatever the order); pipeline stages through the canonical module names (a container recorded on
  several stages is refused). Dropout on either side refuses the pair (TP ranks draw different masks).

Both kinds divide backward entries by the rank's ``grad_scale`` and match an op as the k-th op of its
name inside its module in the micro-batch (ops a layout adds, such as a TP reduce, shift nothing).

Limits: a split tensor's combined shape is known only where ``ps_layout`` names its ``dims``; else its
element count is compared. A forward re-run by activation recomputation is left out (its first call is
compared).
"""

from __future__ import annotations

import dataclasses
import math
from collections import defaultdict
from typing import Any, Iterable

from portspeed.probe.reading.dumps import Entry, Merged, ProbeDump, ProbeInputError, TensorStats, merge, whole

__all__ = ["Slot", "Copy", "Side", "Pairing", "pair_dumps", "PHASE_RANK"]

#: the place of a phase in an iteration's order
PHASE_RANK = {"forward": 0, "backward": 1, "parameters_grad": 2, "parameters_updated": 3}
#: the rank coordinates of the run meta's ``ranks``
_COORDS = ("tp", "pp", "cp", "ep", "dp")
#: the layout fields two runs must share to be compared rank by rank
_LAYOUT_FIELDS = ("tp", "pp", "vpp", "cp", "ep", "etp", "dp", "sp", "distributed_optimizer")
_PER_ITERATION = ("parameters_grad", "parameters_updated")


@dataclasses.dataclass(frozen=True, slots=True, order=True)
class Slot:
    """One compared tensor: where it sits in the iteration, on the reference's layout."""

    iteration: int
    #: the global micro-batch (a same-layout pair: the rank's own); -1: per iteration, or aggregated over it
    micro_batch: int
    phase: str
    module: str
    #: the k-th call of this module in the micro-batch; -1 for an expert aggregated over the iteration
    call: int
    op: str
    #: an op entry: the k-th op of this name inside this module in the micro-batch (-1 aggregated; -1 for modules)
    op_index: int
    field: str
    #: a same-layout pair: the rank both sides hold it on; -1 across layouts
    rank: int = -1
    #: a dump written by msprobe: entries are matched by key ("" otherwise)
    key: str = ""


@dataclasses.dataclass(frozen=True, slots=True)
class Copy:
    """One whole tensor on one side: the ranks it came from (several: split parts joined)."""

    ranks: tuple[int, ...]
    stats: Merged


@dataclasses.dataclass(slots=True)
class Side:
    """One side's view of a slot: its copies, or why it cannot be compared."""

    copies: list[Copy]
    refused: str | None
    #: the sort key of the fixed order (iteration, micro-batch, phase, layer, recording order, field)
    order: tuple
    cls: str
    layer: int | None
    #: the micro-batches that went into an aggregated expert tensor
    micro_batches: tuple[int, ...]
    #: how many tensors the entry holds (more than one: reports name the field)
    fields: int = 1


@dataclasses.dataclass(slots=True)
class Pairing:
    """Both dumps on one layout: ``slots`` maps each tensor to (reference side, run side)."""

    kind: str  # "device" | "layout"
    slots: dict[Slot, tuple[Side | None, Side | None]]
    #: a sentence per thing left out as a whole (a sampler that cannot be matched, recomputed forwards)
    notes: list[str]
    #: the runs' training dtypes (the meta's ``dtype``: reference, run)
    dtype: tuple[str, str]
    #: "reference" / "run" -> why that side's micro-batches could not be matched to the other's
    unmatched: dict[str, str] = dataclasses.field(default_factory=dict)


# ----------------------------------------------------------------------------- the pair

def pair_dumps(ref: ProbeDump, run: ProbeDump, iterations: tuple[int | None, int | None] = (None, None)) -> Pairing:
    """Both dumps' tensors on the reference's layout; `ProbeInputError` when they are not one model's."""
    kind = _check_pair(ref, run)
    lo, hi = iterations
    common = [i for i in ref.iterations if i in set(run.iterations)
              and (lo is None or i >= lo) and (hi is None or i <= hi)]
    if not common:
        raise ProbeInputError(f"no iteration recorded in both dumps (reference {ref.iterations}, run {run.iterations}"
                              f"{'' if iterations == (None, None) else f', window {lo}:{hi}'}); record the same "
                              "iterations with --probe-iterations")
    notes: list[str] = []
    unmatched: dict[str, str] = {}
    a = _side(ref, kind, set(common), run, notes, "reference", unmatched)
    b = _side(run, kind, set(common), ref, notes, "run", unmatched)
    slots = {s: (a.get(s), b.get(s)) for s in sorted(set(a) | set(b))}
    return Pairing(kind, slots, list(dict.fromkeys(notes)),
                   (str(ref.meta.get("dtype") or ""), str(run.meta.get("dtype") or "")), unmatched)


def _check_pair(ref: ProbeDump, run: ProbeDump) -> str:
    """``device`` or ``layout``; the refusals that make the whole comparison meaningless."""
    if not (ref.portspeed and run.portspeed):
        other, ms = (ref, run) if ref.portspeed else (run, ref)
        if other.portspeed and _world(other.meta) != 1:
            raise ProbeInputError(f"{ms.path} is msprobe's own dump (no layout in it): "
                                  f"compare it with a one-rank run, not {other.path} ({_world(other.meta)} ranks)")
        return "device"
    rm, um = ref.meta, run.meta
    diff = _dict_diff(ref.model, run.model)
    if diff:
        raise ProbeInputError(f"the dumps are of different models ({diff}): {ref.path} vs {run.path}; compare runs "
                              "of one model")
    for rel in ("megatron-core", "deepspeed", "transformers"):
        a, b = (rm.get("releases") or {}).get(rel), (um.get("releases") or {}).get(rel)
        if a and b and a != b:
            raise ProbeInputError(f"the dumps are of different {rel} releases ({a} vs {b}): module names and "
                                  f"layouts differ between releases; compare runs of one release")
    if rm.get("global_batch_size") != um.get("global_batch_size"):
        raise ProbeInputError(f"different global batches ({rm.get('global_batch_size')} vs "
                              f"{um.get('global_batch_size')} samples): no iteration sees the same data; use one "
                              "--global-batch-size")
    same = all((rm.get("layout") or {}).get(f) == (um.get("layout") or {}).get(f) for f in _LAYOUT_FIELDS)
    if same:
        return "device"
    for name, m in (("reference", rm), ("run", um)):
        if m.get("dropout"):
            raise ProbeInputError(f"dropout is on in the {name} ({ref.path if m is rm else run.path}): tensor-parallel "
                                  "ranks draw different dropout masks, so different layouts cannot be compared; "
                                  "record both runs with dropout off (--hidden-dropout 0 --attention-dropout 0)")
    return "layout"


def _world(meta: dict[str, Any]) -> int:
    return int(meta.get("world", 1))


def _dict_diff(a: dict[str, Any], b: dict[str, Any]) -> str:
    """The fields both dicts know (not None) and disagree on, as ``k a vs b``."""
    keys = [k for k in dict.fromkeys([*a, *b]) if a.get(k) is not None and b.get(k) is not None and a[k] != b[k]]
    return ", ".join(f"{k} {a[k]!r} vs {b[k]!r}" for k in keys)


# ----------------------------------------------------------------------------- one side

@dataclasses.dataclass(slots=True)
class _Record:
    rank: int
    coords: dict[str, int]
    stats: TensorStats
    entry: Entry
    field_index: int
    micro_batch: int  # the mapped micro-batch this record came from
    layer: int | None  # an op's: its module's (the module entries say where a module sits)


def _side(dump: ProbeDump, kind: str, iterations: set[int], other: ProbeDump, notes: list[str],
          name: str, unmatched: dict[str, str]) -> dict[Slot, Side]:
    records: dict[Slot, list[_Record]] = defaultdict(list)
    ordinals: dict[tuple, int] = defaultdict(int)
    recomputed = 0
    by_key = not (dump.portspeed and other.portspeed)
    for (it, rank), rd in sorted(dump.ranks.items()):
        if it not in iterations:
            continue
        meta = rd.meta
        mapper, why = _mb_mapper(meta, other.meta if other.portspeed else {}, kind)
        coords = {c: int(v) for c, v in (meta.get("ranks") or {}).items() if c in _COORDS}
        scale = _grad_scale(meta, rd.path)
        if kind == "layout" and dump.portspeed and meta.get("grad_scale") is None:
            notes.append(f"the {name}'s gradient scale is not in its meta: its backward entries are compared as "
                         "they are")
        layer_of = {e.module: e.layer for e in rd.entries if not e.op and e.layer is not None}
        outside = -1 if layer_of else None  # no layers at all (msprobe's own dump): recording order alone
        last_layer: dict[tuple[int, str], int] = {}  # (micro-batch, phase) -> the layer of the last module entry
        for e in sorted(rd.entries, key=lambda e: e.seq):
            if not e.op and e.layer is not None:
                last_layer[(e.micro_batch, e.phase)] = e.layer
            if e.recompute:
                recomputed += 1
                continue
            per_iteration = e.phase in _PER_ITERATION or e.micro_batch < 0
            aggregate = kind == "layout" and e.expert is not None and not per_iteration
            if per_iteration:
                mb = -1
            else:
                mb = mapper(e.micro_batch, coords) if mapper else None
                if mb is None and not aggregate:  # an expert is joined over the iteration: its calls need no order
                    unmatched[name] = why
                    notes.append(f"the {name}'s micro-batches cannot be matched ({why}): only per-iteration "
                                 "entries (parameter gradients, parameters after the step, experts) compare")
                    continue
            # the k-th call of this module, or the k-th op of this name inside this module, in the micro-batch:
            # an op's index in its module call shifts where a layout adds ops (a TP reduce), its name's count does not
            ident = (rank, it, mb if not per_iteration else -1, e.phase, e.module, e.op or "")
            k = -1 if aggregate else ordinals[ident]
            if not aggregate:
                ordinals[ident] += 1
            call, op_k = (0, k) if e.op else (k, -1)
            # an op outside every module (the loss, the data) sits after the last module that finished before it
            if e.op:
                layer = layer_of.get(e.module, e.layer) if e.module else last_layer.get((e.micro_batch, e.phase),
                                                                                         outside)
            else:
                layer = e.layer
            for fi, (field, ts) in enumerate(e.tensors):
                if by_key:  # msprobe's own dump on either side: one rank each, its keys are the identity
                    s = Slot(it, 0, e.phase, "", 0, "", -1, field, -1, e.key)
                else:
                    s = Slot(it, -1 if aggregate or per_iteration else mb, e.phase, e.module, call, e.op or "",
                             op_k, field, rank if kind == "device" else -1)
                st = ts if not (e.phase == "backward" and scale != 1.0) else _scaled(ts, scale)
                records[s].append(_Record(0 if by_key else rank, coords, st, e, fi, -1 if mb is None else mb, layer))
    if recomputed:
        notes.append(f"{recomputed} forward entries of the {name} re-run by activation recomputation are left out "
                     "(the first call of each is compared)")
    return {s: _place(s, recs, kind, dump) for s, recs in records.items()}


def _scaled(t: TensorStats, scale: float) -> TensorStats:
    d = lambda x: None if x is None else x / scale  # noqa: E731
    return dataclasses.replace(t, max=d(t.max), min=d(t.min), mean=d(t.mean), norm=d(t.norm))


def _grad_scale(meta: dict[str, Any], where: Any) -> float:
    """The rank's gradient scale; a meta without one (an own loop: None) counts as 1."""
    g = meta.get("grad_scale")
    if g is None:
        return 1.0
    if not isinstance(g, (int, float)) or isinstance(g, bool) or not math.isfinite(g) or g <= 0:
        raise ProbeInputError(f"{where}: grad_scale {g!r} in the run meta is not a positive number")
    return float(g)


def _mb_mapper(meta: dict[str, Any], other: dict[str, Any], kind: str):
    """(rank's micro-batch, coords) -> the micro-batch on the common layout; or (None, why)."""
    if kind == "device":
        return (lambda j, c: j), ""
    lay = meta.get("layout") or {}
    dp, m = int(lay.get("dp", 1)), meta.get("micro_batches")
    if other and meta.get("micro_batch_size") != other.get("micro_batch_size"):
        return None, (f"micro-batch sizes differ: {meta.get('micro_batch_size')} vs {other.get('micro_batch_size')}")
    order = meta.get("dp_order", "unknown")
    if dp == 1:
        return (lambda j, c: j), ""
    if not isinstance(m, int) or m < 1:
        return None, f"micro_batches {m!r} per rank is not in the run meta"
    if order == "contiguous":
        return (lambda j, c: c.get("dp", 0) * m + j), ""
    if order == "single":
        return (lambda j, c: j * dp + c.get("dp", 0)), ""
    return None, f"dp_order {order!r} with {dp} data-parallel ranks"


def _place(slot: Slot, recs: list[_Record], kind: str, dump: ProbeDump) -> Side:
    e0 = recs[0].entry
    mbs = tuple(sorted({r.micro_batch for r in recs if r.micro_batch >= 0}))
    order = _order(slot, recs, mbs)
    side = Side([], None, order, e0.cls, recs[0].layer, mbs, len(e0.tensors))
    if kind == "device":  # one record: the slot names its rank
        side.copies = [Copy((r.rank,), whole(r.stats)) for r in recs]
        return side
    layouts = {r.stats.layout for r in recs}
    groups = {r.stats.groups for r in recs}
    if len(layouts) > 1 or len(groups) > 1:
        side.refused = f"its ranks disagree on the layout ({sorted(layouts)} over {sorted(groups)})"
        return side
    layout, grp = layouts.pop(), groups.pop()
    stages = {r.coords.get("pp", 0) for r in recs}
    if len(stages) > 1:
        side.refused = (f"recorded on {len(stages)} pipeline stages: a {e0.cls or 'module'} each stage runs its own "
                        "part of, no one tensor to compare")
        return side
    meta = dump.ranks[(slot.iteration, recs[0].rank)].meta
    lay = meta.get("layout") or {}
    if layout in ("partial", "unknown") and all(int(lay.get(d) or 1) == 1 for d in ("tp", "cp", "ep", "etp")):
        layout, grp = "full", ()  # nothing spreads this tensor over ranks on this side: it is whole
    if layout == "partial":
        side.refused = (f"a partial sum on each rank (before the reduce) of {_what(e0)}: compared only between "
                        "identical layouts")
        return side
    if layout not in ("full", "split"):
        side.refused = (f"no layout rule for {_what(e0)} (ps_layout {layout!r}): "
                        "how it is spread over the ranks is unknown")
        return side
    aggregate = slot.call == -1
    union = set(grp) if layout == "split" else set()
    if aggregate:
        union |= {"ep", "dp"}  # an expert's tokens on different ranks are different tokens
    parts: dict[tuple, list[_Record]] = defaultdict(list)
    for r in recs:
        parts[tuple(r.coords.get(c, 0) for c in _COORDS if c not in union) + (() if union else (r.rank,))].append(r)
    for members in parts.values():
        ranks = tuple(sorted({r.rank for r in members}))
        if layout == "split" and not aggregate:
            want = math.prod(_group_size(lay, g, e0) for g in grp)
            if len(members) != want:
                side.refused = (f"only {len(members)} of its {want} parts over {'+'.join(grp)} were recorded "
                                f"(ranks {_ranks(ranks)}); record every rank of the group")
                return side
        if len(members) == 1:
            side.copies.append(Copy(ranks, whole(members[0].stats)))
        else:
            shape = None if aggregate else _joined_shape(members, grp)
            side.copies.append(Copy(ranks, merge((m.stats for m in members), shape)))
    side.copies.sort(key=lambda c: c.ranks)
    return side


def _what(e: Entry) -> str:
    """What a refusal names: the module's class, or for an op the ops inside that class (one reason for them all)."""
    if e.op:
        return f"ops inside {e.cls}" if e.cls else "ops outside any module"
    return e.cls or e.key


def _group_size(lay: dict[str, Any], group: str, e: Entry) -> int:
    if group == "tp" and e.expert is not None and lay.get("etp"):
        return int(lay["etp"])
    return int(lay.get(group) or 1)


def _joined_shape(members: list[_Record], groups: Iterable[str]) -> tuple[int, ...] | None:
    """The whole tensor's shape from its parts, where ``ps_layout`` names the split dims; else None."""
    dims = dict(members[0].stats.dims)
    shapes = [m.stats.shape for m in members]
    nd = len(shapes[0])
    if not dims or any(dict(m.stats.dims) != dims or m.stats.flat for m in members) or \
            any(len(s) != nd for s in shapes):
        return None
    split = {g: dims[g] % nd for g in groups if g in dims and -nd <= dims[g] < nd}
    if not split:
        return None
    if len(set(shapes)) == 1:  # even parts: each split dim times the number of parts along its group
        out = list(shapes[0])
        for g, d in split.items():
            out[d] *= len({m.coords.get(g, 0) for m in members})
    elif len(split) == 1:  # uneven parts along one dim
        d = next(iter(split.values()))
        if len({s[:d] + s[d + 1:] for s in shapes}) != 1:
            return None
        out = [*shapes[0][:d], sum(s[d] for s in shapes), *shapes[0][d + 1:]]
    else:
        return None
    return tuple(out) if math.prod(out) == sum(math.prod(s) for s in shapes) else None


def _order(slot: Slot, recs: list[_Record], mbs: tuple[int, ...]) -> tuple:
    """The fixed order: iteration, micro-batch, forward by layer, backward in reverse, parameter entries last."""
    layer = recs[0].layer if recs[0].layer is not None else 0
    per_iteration = slot.phase in _PER_ITERATION
    layer_key = -layer if slot.phase in ("backward", "parameters_grad") else layer
    mb = mbs[0] if mbs else 0
    return (slot.iteration, 1 if per_iteration else 0, mb, PHASE_RANK.get(slot.phase, 4), layer_key,
            min(r.entry.seq for r in recs), recs[0].field_index, slot.rank)


def _ranks(ranks: Iterable[int]) -> str:
    return ",".join(str(r) for r in ranks)
