"""Recording torch's functional collectives (``torch.distributed._functional_collectives``) in the flight recorder.

Why: DTensor, torch TP / SequenceParallel, async-TP and parts of FSDP2 do not call
``torch.distributed``'s collective functions; they call the functional collectives
(``funcol.all_reduce``, ``all_gather_single``...), which go straight to
``torch.ops._c10d_functional.*``. A hang or a desync there was invisible to `portspeed
why-hung`. These frames feed the same recorder (``portspeed.trace.flight_recorder``) through its public
methods, so a functional call takes the next collective sequence number of its process group,
shared with the ``torch.distributed`` calls on that group (torch's own recorder also numbers
per process group), and gets torch's dump fields.

Contract
- Observation only: the functional call gets the caller's arguments and its result or error
  comes back untouched. Under torch.compile, fake or proxy tracing (funcol's own
  ``_are_we_tracing``) and inside another recorded call it is passed straight through.
- The group argument (a group name, a ProcessGroup, a list of ranks, a DeviceMesh, (mesh, dim))
  is resolved as funcol resolves it (``_resolve_group``, then ``_resolve_process_group`` for a
  name). A group torch cannot resolve (ranks of no group) is recorded under group ``?`` with
  ``ps_group_arg``; torch's own error then ends the call, and the recorder keeps it (``fail``).
- Entries are shaped like the matching ``torch.distributed`` op: ``all_reduce``,
  ``broadcast``, ``_all_gather_base`` (output ``[group size * d0, ...]``), ``_reduce_scatter_base``
  (output: the input with the scatter dim divided by the group size; the input as the caller
  passed it, before funcol moves the scatter dim first), ``all_to_all_single``; a ``_coalesced``
  form is one entry with one size per tensor. ``ps_via`` names the functional function
  (``funcol.all_gather_single``); the frames start at the caller's first frame outside torch
  (DTensor reaches funcol through ``torch.autograd.Function.apply``).
- Completion: the call returns an AsyncCollectiveTensor whose collective ends at
  ``wait_tensor``. The entry is handed to ``Recorder.done`` with a stand-in Work whose future
  completes when funcol's ``wait_tensor`` (patched too: every ``AsyncCollectiveTensor`` waits
  through it) returns for a tensor on the result's storage; while that wait blocks, the entry is
  the recorder's ``in_flight`` call (its ``PORTSPEED_TIMEOUT`` dump); a result that is not an
  AsyncCollectiveTensor was already waited (funcol waits itself when it must copy) and is
  completed at once. A result waited through ``torch.ops._c10d_functional.wait_tensor``
  directly (symmetric memory) or never waited stays "scheduled".
- Not recorded: the collectives funcol's autograd kernels issue in backward (registered with
  torch.library, they call the ops directly), the functional point-to-point ``*_inplace``
  functions (only Dynamo's remaps call them), and ``torch.ops._c10d_functional`` called directly.
"""

from __future__ import annotations

import os
import sys
from typing import Any, Callable

from portspeed.trace.flight_recorder import recorder

__all__ = ["RECORDED", "traced"]

#: funcol function -> torch versions it is patched on (the ``_single`` names are torch 2.13's)
RECORDED: dict[str, str] = {
    "all_reduce": ">=2.6", "broadcast": ">=2.6", "all_gather_tensor": ">=2.6", "all_gather_tensor_autograd": ">=2.6",
    "reduce_scatter_tensor": ">=2.6", "reduce_scatter_tensor_autograd": ">=2.6", "all_to_all_single": ">=2.6",
    "all_to_all_single_autograd": ">=2.6", "all_reduce_coalesced": ">=2.6", "all_gather_into_tensor_coalesced": ">=2.6",
    "reduce_scatter_tensor_coalesced": ">=2.6", "all_gather_single": ">=2.13", "all_gather_single_autograd": ">=2.13",
    "reduce_scatter_single": ">=2.13", "reduce_scatter_single_autograd": ">=2.13",
    "all_gather_single_coalesced": ">=2.13", "reduce_scatter_single_coalesced": ">=2.13", "wait_tensor": ">=2.6",
}

# funcol function -> (kind, parameter names in order); kind picks the shaper below
_ALL_REDUCE = ("all_reduce", ("self", "reduceOp", "group", "tag"))
_GATHER = ("gather", ("self", "gather_dim", "group", "tag"))
_SCATTER = ("scatter", ("self", "reduceOp", "scatter_dim", "group", "tag"))
_A2A = ("a2a", ("self", "output_split_sizes", "input_split_sizes", "group", "tag"))
_SIGNATURES: dict[str, tuple[str, tuple[str, ...]]] = {
    "all_reduce": _ALL_REDUCE, "all_reduce_coalesced": _ALL_REDUCE,
    "broadcast": ("broadcast", ("self", "src", "group", "tag")),
    "all_gather_tensor": _GATHER, "all_gather_tensor_autograd": _GATHER, "all_gather_single": _GATHER,
    "all_gather_single_autograd": _GATHER,
    "all_gather_into_tensor_coalesced": ("gather", ("self", "group", "tag")),
    "all_gather_single_coalesced": ("gather", ("self", "group", "tag")),
    "reduce_scatter_tensor": _SCATTER, "reduce_scatter_tensor_autograd": _SCATTER, "reduce_scatter_single": _SCATTER,
    "reduce_scatter_single_autograd": _SCATTER,
    "reduce_scatter_tensor_coalesced": ("scatter", ("inputs", "reduceOp", "scatter_dim", "group", "tag")),
    "reduce_scatter_single_coalesced": ("scatter", ("inputs", "reduceOp", "scatter_dim", "group", "tag")),
    "all_to_all_single": _A2A, "all_to_all_single_autograd": _A2A,
}
_PENDING_MAX = 4096  # results never waited: the oldest stand-in is dropped past this
#: storage address of a returned result -> its stand-in Work, until funcol's wait_tensor returns for it
_pending: dict[int, "_Waited"] = {}
_TORCH_ROOT = "\0"  # torch's package folder (set on install): frames there are not the caller's
_FRAMES = 4


class _Waited:
    """The Work ``Recorder.done`` watches for a functional call: its future completes when the result is waited."""

    __slots__ = ("callback", "entry")

    def __init__(self, entry: dict) -> None:
        self.callback: Callable[[Any], Any] | None = None
        self.entry = entry

    def get_future(self) -> "_Waited":
        return self

    def add_done_callback(self, callback: Callable[[Any], Any]) -> None:
        self.callback = callback


class _Out:
    """The shape and dtype of an output funcol allocates itself (the recorder reads ``shape`` and ``dtype``)."""

    __slots__ = ("shape", "dtype")

    def __init__(self, shape: list, dtype: Any) -> None:
        self.shape, self.dtype = shape, dtype


class _Unresolved:
    """The group of a call whose group argument torch cannot resolve (recorded under group ``?``)."""


def _arg(args: tuple, kwargs: dict, names: tuple[str, ...], i: int, default: Any = None) -> Any:
    return args[i] if len(args) > i else kwargs.get(names[i], default)


def _process_group(group: Any, tag: str, funcol: Any, resolve_name: Callable, by_ranks: Callable) -> Any:
    """The ProcessGroup funcol will use (the caller took a ProcessGroup as it is): funcol's own ``_resolve_group``,
    and for a list of ranks what it calls, without its deprecation warning."""
    if isinstance(group, list):
        group = by_ranks(group, tag)  # what funcol's _resolve_group calls for a list, minus its warning
    else:
        group = funcol._resolve_group(group, tag)
    return resolve_name(group) if isinstance(group, str) else group


def _shape(kind: str, names: tuple[str, ...], args: tuple, kwargs: dict, pg: Any) -> tuple[str, tuple]:
    """The recorder's op name and an argument tuple shaped like that ``torch.distributed`` op's."""
    x = _arg(args, kwargs, names, 0)
    if kind == "all_reduce":
        return "all_reduce", (x, _arg(args, kwargs, names, 1), pg)
    if kind == "broadcast":
        return "broadcast", (x, _arg(args, kwargs, names, 1), pg)
    n = pg.size() if hasattr(pg, "size") else 1
    many = isinstance(x, (list, tuple))
    xs = list(x) if many else [x]
    if kind == "gather":
        outs = [_Out([n * t.shape[0], *t.shape[1:]] if t.dim() else [n], t.dtype) for t in xs]
        return "all_gather_into_tensor", (outs if many else outs[0], x, pg)
    if kind == "scatter":
        dims = _arg(args, kwargs, names, 2, 0)
        dims = list(dims) if isinstance(dims, (list, tuple)) else [dims] * len(xs)
        outs = []
        for t, d in zip(xs, dims):
            s = list(t.shape)
            s[d] //= n
            outs.append(_Out(s, t.dtype))
        return "reduce_scatter_tensor", (outs if many else outs[0], x, _arg(args, kwargs, names, 1), pg)
    splits = _arg(args, kwargs, names, 1)  # all_to_all_single: the output's first dim is the sum of its splits
    rows = sum(int(s) for s in splits) if splits is not None else x.shape[0]
    return "all_to_all_single", (_Out([rows, *x.shape[1:]], x.dtype), x, splits, _arg(args, kwargs, names, 2), pg)


#: portspeed's own folders a call passes through before torch: the recorder's (here) and the router's (comm/, by
#: path: this floor imports nothing of portspeed.comm)
_OWN_DIRS = (os.path.dirname(__file__) + os.sep,
             os.path.join(os.path.dirname(os.path.dirname(__file__)), "comm") + os.sep)


def _user_frames(f: Any) -> list[dict]:
    """The caller's frames, first outside torch's own package (DTensor, autograd, nn.Module), the recorder's and
    the router's (``portspeed.trace``, ``portspeed.comm``)."""
    while f is not None and f.f_code.co_filename.startswith((_TORCH_ROOT, *_OWN_DIRS)):
        f = f.f_back
    frames = []
    while f is not None and len(frames) < _FRAMES:
        frames.append({"name": f.f_code.co_name, "filename": f.f_code.co_filename, "line": f.f_lineno})
        f = f.f_back
    return frames


def _watch(rec: Any, e: dict, out: Any, acs: type) -> None:
    """Hand the entry to the recorder: completed now (already waited) or when its result is waited."""
    results = out if isinstance(out, (list, tuple)) else (out,)
    keys = []
    for r in results:
        if type(r) is acs or isinstance(r, acs):
            try:
                keys.append(r.elem.untyped_storage().data_ptr())
            except Exception:  # no storage to key on: its wait is not seen
                pass
    if not keys:
        rec.done(e, None)
        return
    w = _Waited(e)
    rec.done(e, [w])
    for k in keys:
        _pending[k] = w
    while len(_pending) > _PENDING_MAX:
        del _pending[next(iter(_pending))]


def traced(name: str) -> Callable[[Callable], Callable]:
    """A factory ``make(original) -> recorded`` (``style="function"``) for the funcol function ``name``."""

    def make(original: Callable) -> Callable:
        global _TORCH_ROOT
        rec = recorder()
        if rec is None:
            return original
        import torch
        import torch.distributed._functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        _TORCH_ROOT = os.path.dirname(torch.__file__) + os.sep
        acs = funcol.AsyncCollectiveTensor
        tracing = getattr(funcol, "_are_we_tracing", torch.compiler.is_dynamo_compiling)
        if name == "wait_tensor":
            return _wait(original, torch.compiler.is_dynamo_compiling, rec)
        kind, names = _SIGNATURES[name]
        gpos = names.index("group")
        resolve_name, by_ranks = c10d._resolve_process_group, c10d._resolve_group_name_by_ranks_and_tag
        process_group = c10d.ProcessGroup

        via = f"funcol.{name}"
        in_place = kind in ("all_reduce", "broadcast")  # output sized as the input: the args pass as they are

        def recorded(*args: Any, **kwargs: Any) -> Any:
            if tracing() or rec.busy:
                return original(*args, **kwargs)
            group = args[gpos] if len(args) > gpos else kwargs.get("group")
            if isinstance(group, process_group):
                pg = group
            else:
                try:
                    pg = _process_group(group, _arg(args, kwargs, names, gpos + 1, "") or "", funcol, resolve_name,
                                        by_ranks)
                except Exception:  # torch will refuse this group the same way: record the call under group "?"
                    pg = _Unresolved()
            try:
                if in_place and len(args) > 1:
                    e = rec.issue(kind, (args[0], args[1], pg), {})
                else:
                    op, shaped = _shape(kind, names, args, kwargs, pg)
                    e = rec.issue(op, shaped, {})
            except Exception:  # arguments funcol itself will refuse (not tensors...): its error, not ours
                rec.busy = False
                return original(*args, **kwargs)
            e["ps_via"] = via
            if type(pg) is _Unresolved:
                e["ps_group_arg"] = repr(group)[:200]
            frames = e["frames"]
            if frames and frames[0]["filename"].startswith(_TORCH_ROOT):
                e["frames"] = _user_frames(sys._getframe(1))
            try:
                out = original(*args, **kwargs)
            except BaseException as error:
                rec.fail(e, error)
                raise
            if type(out) is acs:  # the usual result: one AsyncCollectiveTensor
                try:
                    key = out.elem.untyped_storage().data_ptr()
                except Exception:  # no storage to key on: its wait is not seen
                    rec.done(e, None)
                    return out
                w = _Waited(e)
                rec.done(e, [w])
                _pending[key] = w
                if len(_pending) > _PENDING_MAX:
                    del _pending[next(iter(_pending))]
            else:
                _watch(rec, e, out, acs)
            return out

        recorded.__name__ = recorded.__qualname__ = getattr(original, "__name__", name)
        recorded.__doc__ = f"funcol.{name}, recorded by portspeed.trace.funcol.\n\n" + (original.__doc__ or "")
        recorded.__wrapped__ = original  # type: ignore[attr-defined]
        return recorded

    make.__name__ = make.__qualname__ = f"trace_funcol_{name}"
    return make


def _wait(original: Callable, compiling: Callable[[], bool], rec: Any) -> Callable:
    """funcol's ``wait_tensor``: the call whose result lives on this storage is in flight while it waits (the
    recorder's in-flight timeout sees a hung wait), and completed when it returns."""

    def wait_tensor(tensor: Any) -> Any:
        if compiling() or not _pending:  # compiling first: Dynamo must not guard on the dict
            return original(tensor)
        try:
            w = _pending.pop(tensor.untyped_storage().data_ptr(), None)
        except Exception:  # no storage (a fake tensor...): not one of ours
            w = None
        if w is None:
            return original(tensor)
        e = w.entry
        if rec.in_flight is None:  # no synchronous call under way
            rec.in_flight = e
        try:
            out = original(tensor)
        finally:
            if rec.in_flight is e:
                rec.in_flight = None
        if w.callback is not None:
            w.callback(None)
        return out

    wait_tensor.__doc__ = original.__doc__
    wait_tensor.__wrapped__ = original  # type: ignore[attr-defined]
    return wait_tensor
