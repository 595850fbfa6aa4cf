"""The rewrite ladder, as a table: how a call the backend gets wrong becomes calls it does right.

Why: all_reduce, reduce, reduce_scatter_tensor and the list reduce_scatter lack the same
things on Gloo and vendor CCLs (a dtype, AVG, PREMUL_SUM, an op) and are rewritten the
same way; one rule per rewrite, named, replaces a copy of the ladder per collective.
all_gather_into_tensor lacks no op or dtype, only a form of its output (Gloo wants each
dim-0 chunk shaped as the input; NCCL counts elements): its one rule is a view.

Contract
- A ``Call`` is one collective call taken apart: where the result lands (``output``), what
  is read (``inputs``: the output itself for all_reduce/reduce, a tensor or a list
  otherwise), the op, the group, the gap the table reported, and ``again``: the same
  collective on other tensors or another op, issued through the router (so gaps compose:
  AVG on a bf16 reduce_scatter becomes a float32 SUM, divided, then rounded once).
  ``reduce`` calls carry ``is_dst``: only the destination's tensor receives the result.
- ``LADDERS[collective]`` lists ``(rewrite, when)`` steps; the first whose ``when(gap, op)``
  holds is used. ``RULES[rewrite]`` is ``(check, rule)``: ``check`` may refuse the call
  (CollectiveUnsupportedError saying what to do) before it is counted; ``rule(call,
  async_op)`` issues the inner collectives and returns what torch's collective returns
  (None, or a ``RewriteWork`` whose ``wait()`` finishes the rewrite).
- The rewrites: ``upcast`` (an unsupported dtype computed in float32, written back;
  float64 refused), ``avg_as_sum`` (SUM then divide; floats only), ``premul_as_scale_sum``
  (scale then SUM; floats only), ``via_all_gather`` (other ops of all_reduce/reduce:
  gather, reduce locally in rank order), ``via_all_reduce_slice`` (reduce_scatter_tensor:
  all_reduce then keep this rank's slice), ``via_reduce_scatter_tensor`` (list
  reduce_scatter), ``via_all_to_all_single`` (list all_to_all), ``view_output_as_chunks``
  (all_gather_into_tensor whose output is contiguous, holds world x the input's elements
  and is not chunk-shaped: the output viewed as ``(world * input.shape[0], *input.shape[1:])``,
  a 0-d input and its output as 1-d; the router checks those conditions before the rule).
- Rules in ``IN_BATCH`` issue one collective on views of the caller's own tensors and have
  no last step: the backend's own work (or None) is returned, and inside a coalescing
  batch the call is recorded in the batch as the original would be. Every other rule runs
  outside the batch (``work.run``).
- ``stats()`` counts, per collective, the calls rewritten and by which rule; the first
  rewrite of each kind is logged once. Straight calls are never counted.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portspeed.accelerator.capabilities import Gap, op_type
from portspeed.comm.work import complete, nothing, run
from portspeed.errors import CollectiveUnsupportedError

__all__ = ["Call", "IN_BATCH", "LADDERS", "RULES", "rewrite", "stats", "explain", "reset_stats"]

log = logging.getLogger("portspeed.comm.router")

RedOpType = dist.ReduceOp.RedOpType
_SUM = dist.ReduceOp.SUM

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn and delegate)
_RS_TENSOR = "reduce_scatter_single" if hasattr(c10d, "reduce_scatter_single") else "reduce_scatter_tensor"
_AG_TENSOR = "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"

_stats_lock = threading.Lock()
_STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


@dataclasses.dataclass(eq=False)
class Call:
    """One collective call being rewritten, in the shape every rule reads."""

    collective: str
    output: Any  #: where the result lands (a tensor; the output list for all_to_all)
    inputs: Any  #: what is read: ``output`` itself (in place), a tensor, or a list of tensors
    op: Any
    group: Any
    gap: Gap
    probe: torch.Tensor  #: the tensor whose dtype the capability table was asked about
    again: Callable[[Any, Any, Any, bool], Any]  #: ``again(output, inputs, op, async_op)``, through the router
    is_dst: Callable[[], bool] | None = None  #: reduce only: whether this rank receives the result
    opt: Any = dataclasses.field(init=False)  #: the canonical RedOpType of ``op``
    n: int = dataclasses.field(init=False)  #: the group's world size
    mine: bool = dataclasses.field(init=False, default=True)  #: this rank receives the result

    def __post_init__(self) -> None:
        self.opt = op_type(self.op)
        self.n = dist.get_world_size(self.group)


# ---------------------------------------------------------------------- helpers
def _require_float(c: Call, what: str) -> None:
    if not c.probe.is_floating_point():
        raise CollectiveUnsupportedError(
            f"{c.collective} with {what} on {c.probe.dtype} tensors: the backend lacks it and portspeed only "
            "rewrites it for floating-point tensors; use SUM and divide yourself, or cast to a float dtype"
        )


def _factor(op: Any) -> Any:
    """The factor of a PREMUL_SUM ReduceOp: a float or a 1-element tensor.

    ``ReduceOp.factor`` is a later release's property (2.13.0 has it; 2.6.0, 2.8.0 and 2.11.0 do
    not), but every release run (those four) pickles the op as ``(RedOpType, factor)`` through
    ``__getstate__``, so the factor is read there on the older ones.
    """
    f = getattr(op, "factor", None)
    if f is None:
        state = getattr(op, "__getstate__", None)
        try:
            got = state() if callable(state) else None
        except (RuntimeError, TypeError):
            got = None
        if isinstance(got, tuple) and len(got) == 2:
            f = got[1]
    if f is None:
        raise CollectiveUnsupportedError(
            f"PREMUL_SUM {op!r} carries no factor that torch {torch.__version__} shows (no ReduceOp.factor, no "
            "(op, factor) state); build it with torch.distributed._make_nccl_premul_sum(factor), or pass "
            "ReduceOp.SUM on tensors you scaled yourself"
        )
    return f


def _upcast_target(c: Call) -> torch.dtype:
    if c.probe.dtype == torch.float64:
        raise CollectiveUnsupportedError(
            f"{c.collective} on float64: the backend {c.gap.note!r}; portspeed cannot emulate float64 exactly. "
            "Cast to float32 yourself if that precision is enough"
        )
    return torch.float32


def _each(inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return [fn(t) for t in inputs] if isinstance(inputs, list) else fn(inputs)


def _local_reduce(stacked: torch.Tensor, op: Any) -> torch.Tensor:
    """Reduce dim 0 of ``stacked`` with ``op``, in rank order."""
    if op == RedOpType.MAX:
        return stacked.amax(0)
    if op == RedOpType.MIN:
        return stacked.amin(0)
    if op == RedOpType.PRODUCT:
        return stacked.prod(0, dtype=stacked.dtype)
    if op == RedOpType.SUM:
        return stacked.sum(0, dtype=stacked.dtype)
    fns = {RedOpType.BAND: torch.bitwise_and, RedOpType.BOR: torch.bitwise_or, RedOpType.BXOR: torch.bitwise_xor}
    if op in fns:
        return functools.reduce(fns[op], list(stacked.unbind(0)))
    raise CollectiveUnsupportedError(f"no local rewrite for reduce op {op!r}")


# ---------------------------------------------------------------------- rules
def _upcast(c: Call, async_op: bool) -> Any:
    dt = _upcast_target(c)
    if c.inputs is c.output:  # in place: all_reduce, reduce
        tmp = c.output.to(dt)
        w = c.again(tmp, tmp, c.op, async_op)
        return complete([w], lambda: c.output.copy_(tmp) if c.mine else None, async_op)
    out = c.output.to(dt)
    w = c.again(out, _each(c.inputs, lambda t: t.to(dt)), c.op, async_op)
    return complete([w], lambda: c.output.copy_(out), async_op)


def _avg_as_sum(c: Call, async_op: bool) -> Any:
    n = c.n
    if c.is_dst is not None:  # reduce: on a copy, only the destination's tensor is written
        tmp = c.output.clone()
        w = c.again(tmp, tmp, _SUM, async_op)
        return complete([w], lambda: c.output.copy_(tmp.div_(n)) if c.mine else None, async_op)
    w = c.again(c.output, c.inputs, _SUM, async_op)
    return complete([w], lambda: c.output.div_(n), async_op)


def _premul_as_scale_sum(c: Call, async_op: bool) -> Any:
    f = _factor(c.op)
    if c.is_dst is not None:  # reduce: on a scaled copy, only the destination's tensor is written
        tmp = c.output * f
        w = c.again(tmp, tmp, _SUM, async_op)
        return complete([w], lambda: c.output.copy_(tmp) if c.mine else None, async_op)
    if c.inputs is c.output:  # all_reduce: scale in place, the result lands there
        c.output.mul_(f)
        w = c.again(c.output, c.output, _SUM, async_op)
    else:
        w = c.again(c.output, _each(c.inputs, lambda t: t * f), _SUM, async_op)
    return complete([w], nothing, async_op)


def _via_all_gather(c: Call, async_op: bool) -> Any:
    n, opt = c.n, c.opt
    flat = c.output.reshape(-1).contiguous()
    gathered = flat.new_empty(n * flat.numel())
    w = getattr(c10d, _AG_TENSOR)(gathered, flat, group=c.group, async_op=async_op)

    def finish() -> None:
        if c.mine:
            c.output.copy_(_local_reduce(gathered.view(n, -1), opt).view_as(c.output))

    return complete([w], finish, async_op)


def _via_all_reduce_slice(c: Call, async_op: bool) -> Any:
    tmp = c.inputs.reshape(-1).clone()
    w = c10d.all_reduce(tmp, op=c.op, group=c.group, async_op=async_op)
    m, r = c.output.numel(), dist.get_rank(c.group)
    return complete([w], lambda: c.output.copy_(tmp[r * m:(r + 1) * m].view_as(c.output)), async_op)


def _via_reduce_scatter_tensor(c: Call, async_op: bool) -> Any:
    flat_in = torch.cat([t.reshape(-1) for t in c.inputs])
    flat_out = c.output.new_empty(c.output.numel())
    w = getattr(c10d, _RS_TENSOR)(flat_out, flat_in, op=c.op, group=c.group, async_op=async_op)
    return complete([w], lambda: c.output.copy_(flat_out.view_as(c.output)), async_op)


def _via_all_to_all_single(c: Call, async_op: bool) -> Any:
    flat_in = torch.cat([t.reshape(-1) for t in c.inputs])
    in_splits = [t.numel() for t in c.inputs]
    out_splits = [t.numel() for t in c.output]
    flat_out = flat_in.new_empty(sum(out_splits))
    w = c10d.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=c.group, async_op=async_op)

    def finish() -> None:
        for t, piece in zip(c.output, flat_out.split(out_splits)):
            t.copy_(piece.view_as(t))

    return complete([w], finish, async_op)


def _view_output_as_chunks(c: Call, async_op: bool) -> Any:
    ins = c.inputs if c.inputs.dim() else c.inputs.view(1)
    out = c.output.view(c.n * ins.shape[0], *ins.shape[1:])  # shares the caller's storage
    return c.again(out, ins, c.op, async_op)  # the backend's own work: nothing is left to do at wait()


Check = Callable[[Call], None]
Rule = Callable[[Call, bool], Any]

#: rewrite name -> (check run before the call is counted, or None; the rule)
RULES: dict[str, tuple[Check | None, Rule]] = {
    "upcast": (None, _upcast),
    "avg_as_sum": (lambda c: _require_float(c, "AVG"), _avg_as_sum),
    "premul_as_scale_sum": (lambda c: _require_float(c, "PREMUL_SUM"), _premul_as_scale_sum),
    "via_all_gather": (None, _via_all_gather),
    "via_all_reduce_slice": (None, _via_all_reduce_slice),
    "via_reduce_scatter_tensor": (None, _via_reduce_scatter_tensor),
    "via_all_to_all_single": (None, _via_all_to_all_single),
    "view_output_as_chunks": (None, _view_output_as_chunks),
}

#: rules that issue one collective on the caller's storage and nothing after it (see the docstring)
IN_BATCH = frozenset({"view_output_as_chunks"})

When = Callable[[Gap, Any], bool]


def _dtype_gap(gap: Gap, opt: Any) -> bool:
    return gap.dtype is not None


def _avg(gap: Gap, opt: Any) -> bool:
    return opt == RedOpType.AVG


def _premul(gap: Gap, opt: Any) -> bool:
    return opt == RedOpType.PREMUL_SUM


def _op_gap_avg(gap: Gap, opt: Any) -> bool:
    return gap.op is not None and opt == RedOpType.AVG


def _op_gap_premul(gap: Gap, opt: Any) -> bool:
    return gap.op is not None and opt == RedOpType.PREMUL_SUM


def _otherwise(gap: Gap, opt: Any) -> bool:
    return True


_DTYPE_AVG_PREMUL: tuple[tuple[str, When], ...] = (
    ("upcast", _dtype_gap), ("avg_as_sum", _avg), ("premul_as_scale_sum", _premul))

#: collective -> its ladder: (rewrite, when) steps, tried in order (dtype gaps first, so a
#: float32 call then meets the op's own rewrite). The list reduce_scatter takes AVG and
#: PREMUL_SUM apart only for an op gap: when the whole collective is missing it goes
#: through reduce_scatter_tensor with the caller's op.
LADDERS: dict[str, tuple[tuple[str, When], ...]] = {
    "all_reduce": _DTYPE_AVG_PREMUL + (("via_all_gather", _otherwise),),
    "reduce": _DTYPE_AVG_PREMUL + (("via_all_gather", _otherwise),),
    "reduce_scatter_tensor": _DTYPE_AVG_PREMUL + (("via_all_reduce_slice", _otherwise),),
    "reduce_scatter": (("upcast", _dtype_gap), ("avg_as_sum", _op_gap_avg), ("premul_as_scale_sum", _op_gap_premul),
                       ("via_reduce_scatter_tensor", _otherwise)),
    "all_to_all": (("via_all_to_all_single", _otherwise),),
    "all_gather_into_tensor": (("view_output_as_chunks", _otherwise),),
}


def rewrite(c: Call, async_op: bool) -> Any:
    """Rewrite ``c`` by the first step of its ladder that applies; what torch's collective would return."""
    name = next(step for step, when in LADDERS[c.collective] if when(c.gap, c.opt))
    check, rule = RULES[name]

    def body(inner_async: bool) -> Any:
        if c.is_dst is not None:
            c.mine = c.is_dst()
        if check is not None:
            check(c)
        _count(c.collective, name)
        return rule(c, inner_async)

    return run(c.group, async_op, body, in_batch=name in IN_BATCH)


# ---------------------------------------------------------------------- counting
def stats() -> dict[str, dict[str, Any]]:
    """Per collective: how many calls were rewritten, and by which rewrite."""
    with _stats_lock:
        return {k: {"rewrites": sum(c.values()), "by": dict(c)} for k, c in sorted(_STATS.items()) if c}


#: what each rewrite does, in words (``explain``)
_HOW: dict[str, str] = {
    "upcast": "the dtype was upcast to one the backend reduces, then cast back",
    "avg_as_sum": "AVG ran as SUM, then a division by the group size",
    "premul_as_scale_sum": "PREMUL_SUM ran as a scaling, then SUM",
    "via_all_gather": "ran as an all_gather and a local reduction",
    "via_all_reduce_slice": "ran as an all_reduce and a slice of this rank's part",
    "via_reduce_scatter_tensor": "the list form ran as reduce_scatter_tensor on one flat buffer",
    "via_all_to_all_single": "the list form ran as all_to_all_single on one flat buffer",
    "view_output_as_chunks": "the output was viewed as chunks shaped like the input (same storage)",
}


def explain(counts: dict[str, dict[str, Any]] | None = None) -> str:
    """``stats()`` (or a saved copy) as a sentence: which collectives the backend lacked and how each was rewritten."""
    counts = stats() if counts is None else counts
    if not counts:
        return "router rewrites: none needed (the backend ran every collective as requested)"
    parts = []
    for collective, entry in sorted(counts.items()):
        for how, n in sorted(entry.get("by", {}).items()):
            parts.append(f"{collective} x{n}: {_HOW.get(how, how)}")
    return "router rewrites: the backend lacked some collectives; " + "; ".join(parts)


def reset_stats() -> None:
    """Zero the rewrite counters (tests, benchmarks)."""
    with _stats_lock:
        _STATS.clear()


def _count(collective: str, rewrite: str) -> None:
    with _stats_lock:
        first = _STATS[collective][rewrite] == 0
        _STATS[collective][rewrite] += 1
    if first:  # once per (collective, rewrite): visible in stock Megatron logs, free afterwards
        log.warning("portspeed: the backend lacks this form of %s; rewritten (%s). "
                    "Counts: portspeed.comm.stats(); this line is logged once.", collective, rewrite)
