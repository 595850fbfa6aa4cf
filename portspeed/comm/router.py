"""The routed collectives: the hot path in front of torch's collective, and each signature taken apart.

Why: every all_reduce Megatron issues passes through here, so the straight case must cost
next to nothing (docs/benchmarks.md, "all_reduce": the screen costs ~1.8%, one Python
frame more is visible). ``COLLECTIVE_ROUTES[name]`` makes, from torch's function, a plain
function (``Patch(style="function")``, no wrapt object) that sends a call straight
through when the group's cached capability table lists no gap for its op and dtype, and
otherwise hands it to the collective's function here, which takes torch's signature apart
into a ``rewrites.Call``.

Contract
- Straight calls: ``original`` gets the caller's own arguments, untouched; when it is
  torch's exception-logging layer the function under it is called and errors are handed
  back to that layer (same record, same error, one frame fewer); while Dynamo traces,
  ``original`` itself is called (Dynamo maps it to a functional collective).
- Per call on the hot path: ``len(args)``, one ``dict.get`` on the group cache
  (``groups._CAPS``, bound once), one ``_quick.get`` on the table; for reducing
  collectives with a gap listed, the op's identity and (if a dtype gap exists) the dtype.
- ``all_reduce``, ``reduce``, ``reduce_scatter_tensor``, ``reduce_scatter``, ``all_to_all``,
  ``all_gather_into_tensor`` (signature ``(wrapped, *torch's arguments)``) look up the gap
  and either call ``wrapped`` or rewrite (``rewrites.rewrite``).
- ``all_gather_into_tensor`` (and torch 2.13's ``all_gather_single``): its only gap is the
  output's shape (Gloo, testccl: each dim-0 chunk must be shaped as the input). Where the
  table lists it, the hot path also compares the output's and the input's dimensions and,
  above 1-d, their trailing sizes (two ``.dim()`` calls, then two ``.shape`` reads and a
  tuple compare); a chunk-shaped call goes straight. A call whose output is contiguous,
  holds world x the input's elements and is not chunk-shaped (flat, stacked, a 0-d input)
  goes to the backend on views of the caller's tensors (``view_output_as_chunks``);
  anything else goes straight and the backend answers it. Where the table lists no such
  gap (NCCL, the stand-in), the screen is the two dict reads above (docs/benchmarks.md,
  "all_gather").
- This module also re-exports the router's public names (``map_backend``, ``real_backend``,
  ``stats``...) for callers that import ``portspeed.comm.router``; new code imports them from
  ``portspeed.comm``.

Limits: functional collectives (``torch.distributed._functional_collectives``) do not
pass through here.

Example::

    dist.init_process_group("nccl")          # on the CPU adapter: runs Gloo
    dist.get_backend()                       # 'nccl'
    portspeed.comm.real_backend()            # 'gloo'
    portspeed.comm.stats()                   # {'all_reduce': {'rewrites': 2, 'by': {'avg_as_sum': 2}}}
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portspeed.comm.backends import map_backend, real_backend, requested_backend
from portspeed.accelerator.capabilities import CANONICAL_OP_IDS as _CANONICAL_OP_IDS, Gap
from portspeed.comm.groups import _CAPS, capabilities_of, forget_all, use_capabilities
from portspeed.comm.rewrites import _AG_TENSOR, _RS_TENSOR, Call, reset_stats, rewrite, stats
from portspeed.comm.inflight import note as note_work
from portspeed.comm.work import RewriteWork, nothing as _nothing

__all__ = [
    "COLLECTIVE_ROUTES",
    "RewriteWork",
    "all_gather_into_tensor",
    "all_reduce",
    "all_to_all",
    "capabilities_of",
    "map_backend",
    "real_backend",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "requested_backend",
    "reset",
    "reset_stats",
    "stats",
    "use_capabilities",
]

_SUM = dist.ReduceOp.SUM


def reset() -> None:
    """Forget cached tables, requested names and counters."""
    forget_all()
    reset_stats()


# ---------------------------------------------------------------------- each collective's signature
def _gap(collective: str, group: Any, op: Any, tensor: torch.Tensor) -> Gap | None:
    """The capability gap of this call, or None (straight through)."""
    caps = _CAPS.get(group)
    if caps is None or type(caps) is dict:
        caps = capabilities_of(group, tensor.device.type)
    return caps.gap(collective, op, tensor.dtype)


def all_reduce(wrapped: Callable, tensor: torch.Tensor, op: Any = _SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """all_reduce through the capability table of ``group``."""
    gap = _gap("all_reduce", group, op, tensor)
    if gap is None:
        return wrapped(tensor, op=op, group=group, async_op=async_op)

    def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
        return c10d.all_reduce(out, op=o, group=group, async_op=a)

    return rewrite(Call("all_reduce", tensor, tensor, op, group, gap, tensor, again), async_op)


def reduce(wrapped: Callable, tensor: torch.Tensor, dst: Any = None, op: Any = _SUM, group: Any = None,
           async_op: bool = False, **kwargs: Any) -> Any:
    """reduce through the capability table of ``group`` (``group_dst`` passes through)."""
    gap = _gap("reduce", group, op, tensor)
    if gap is None:
        return wrapped(tensor, dst, op=op, group=group, async_op=async_op, **kwargs)
    group_dst = kwargs.get("group_dst")

    def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
        return c10d.reduce(out, dst, op=o, group=group, async_op=a, **kwargs)

    def is_dst() -> bool:
        if group_dst is not None:
            return dist.get_rank(group) == group_dst
        return dist.get_rank() == dst

    return rewrite(Call("reduce", tensor, tensor, op, group, gap, tensor, again, is_dst), async_op)


def reduce_scatter_tensor(wrapped: Callable, output: torch.Tensor, input: torch.Tensor, op: Any = _SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    """reduce_scatter_tensor through the capability table of ``group``."""
    gap = _gap("reduce_scatter_tensor", group, op, input)
    if gap is None:
        return wrapped(output, input, op=op, group=group, async_op=async_op)

    def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
        return getattr(c10d, _RS_TENSOR)(out, ins, op=o, group=group, async_op=a)

    return rewrite(Call("reduce_scatter_tensor", output, input, op, group, gap, input, again), async_op)


def reduce_scatter(wrapped: Callable, output: torch.Tensor, input_list: list, op: Any = _SUM,
                   group: Any = None, async_op: bool = False) -> Any:
    """list reduce_scatter through the capability table of ``group``."""
    gap = _gap("reduce_scatter", group, op, output)
    if gap is None:
        return wrapped(output, input_list, op=op, group=group, async_op=async_op)

    def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
        return c10d.reduce_scatter(out, ins, op=o, group=group, async_op=a)

    return rewrite(Call("reduce_scatter", output, input_list, op, group, gap, output, again), async_op)


def all_to_all(wrapped: Callable, output_tensor_list: list, input_tensor_list: list, group: Any = None,
               async_op: bool = False) -> Any:
    """list all_to_all through the capability table of ``group``."""
    probe = input_tensor_list[0] if input_tensor_list else None
    gap = _gap("all_to_all", group, _SUM, probe) if probe is not None else None
    if gap is None:
        return wrapped(output_tensor_list, input_tensor_list, group=group, async_op=async_op)

    def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
        return c10d.all_to_all(out, ins, group=group, async_op=a)

    return rewrite(Call("all_to_all", output_tensor_list, input_tensor_list, _SUM, group, gap, probe, again),
                   async_op)


def _needs_view(output: torch.Tensor, input: torch.Tensor, group: Any) -> bool:
    """Whether only the form of ``output`` keeps this all_gather from a backend that wants chunk-shaped
    outputs: contiguous, world x the input's elements, not chunk-shaped (a 0-d input never is)."""
    if input.dim() and output.shape[1:] == input.shape[1:]:
        return False  # chunk-shaped, or a count the backend refuses itself (as it would without portspeed)
    n = dist.get_world_size(group)
    return n > 0 and output.is_contiguous() and output.numel() == n * input.numel()


def all_gather_into_tensor(wrapped: Callable, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                           group: Any = None, async_op: bool = False) -> Any:
    """all_gather_into_tensor through the capability table of ``group``: a flat or stacked output is
    viewed as chunks shaped like the input where the backend wants that (Gloo)."""
    if isinstance(output_tensor, torch.Tensor) and isinstance(input_tensor, torch.Tensor):
        gap = _gap("all_gather_into_tensor", group, None, input_tensor)
        if gap is not None and _needs_view(output_tensor, input_tensor, group):

            def again(out: Any, ins: Any, o: Any, a: bool) -> Any:
                return getattr(c10d, _AG_TENSOR)(out, ins, group=group, async_op=a)

            return rewrite(Call("all_gather_into_tensor", output_tensor, input_tensor, _SUM, group, gap,
                                input_tensor, again), async_op)
    return wrapped(output_tensor, input_tensor, group=group, async_op=async_op)


# ---------------------------------------------------------------------- the hot path
#: every name torch's exception-logging wrapper uses (torch 2.6 to 2.13): it only logs on an
#: exception. A decorator that uses any other name may do more on success and is not bypassed.
_LOGGING_LAYER_NAMES = frozenset({"Exception", "_get_msg_dict", "__name__", "_c10d_logger", "debug"})


def _torch_logging_layer(original: Callable) -> tuple[Callable, Callable | None]:
    """``(undecorated, decorator)`` when ``original`` is torch's c10d exception-logging wrapper.

    torch wraps each collective in ``c10d_logger._exception_logger``, a layer that only
    logs a debug record when the call raises. The routed function takes that layer's place
    instead of stacking a frame on it: on the hot path it calls the undecorated function,
    and when that raises it hands the error to torch's own decorator, so the record is
    logged as before and the same error propagates. Recognised by code identity (every
    wrapper that decorator makes shares one code object); anything else, a newer torch's
    decorator or another library's wrapper, is called as it is: ``(original, None)``.
    """
    try:
        from torch.distributed.c10d_logger import _exception_logger as decorator
    except ImportError:
        return original, None
    code = getattr(original, "__code__", None)
    if (code is None or code is not decorator(_nothing).__code__ or code.co_freevars != ("func",)
            or not set(code.co_names) <= _LOGGING_LAYER_NAMES):
        return original, None
    inner = original.__closure__[0].cell_contents
    return (inner, decorator) if callable(inner) else (original, None)


def _raise_through(decorator: Callable, inner: Callable, error: Exception, args: tuple, kwargs: dict) -> None:
    """Let torch's logging decorator see ``error`` as if it had made the call: it logs, then re-raises."""

    def failed(*_a: Any, **_k: Any) -> Any:
        raise error

    failed.__name__, failed.__qualname__ = inner.__name__, inner.__qualname__
    decorator(failed)(*args, **kwargs)
    raise error  # the decorator always re-raises; this is only reached if a future one swallows it


def _route(name: str, fn: Callable, tensor_at: tuple[int, str] | None, op_at: int | None,
           group_at: int) -> Callable[[Callable], Callable]:
    """A factory ``make(original) -> routed`` for a ``style="function"`` wrap patch of a collective.

    ``routed`` is a plain function (no wrapt object, no re-packing of the arguments): every
    collective Megatron issues passes through it, and on a two-rank ping-pong each object
    it touches before the call shows in the latency (docs/benchmarks.md). The hot path:
    when the group's table is cached and lists no gap for this op and dtype, ``original``
    gets the caller's own arguments, untouched; otherwise ``fn`` (the rewrite) decides.
    When ``original`` is torch's exception-logging wrapper, the hot path calls the function
    under it and hands errors back to it (``_torch_logging_layer``): the same behaviour,
    one Python frame fewer, so the call has as many frames as without portspeed. While
    Dynamo traces, ``original`` is called instead: Dynamo maps it, by identity, to a
    functional collective.
    ``tensor_at``/``op_at``/``group_at`` are the positions (and the tensor's keyword) of
    the arguments in torch's signature.
    """
    t_pos, t_kw = tensor_at if tensor_at is not None else (-1, "")
    caps_get, canonical = _CAPS.get, _CANONICAL_OP_IDS  # _CAPS is only ever mutated, never rebound
    compiling = torch.compiler.is_dynamo_compiling  # False when run; Dynamo reads it as True while tracing

    def make(original: Callable) -> Callable:
        call, logging_layer = _torch_logging_layer(original)

        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            n = len(args)
            caps = caps_get(args[group_at] if n > group_at else kwargs.get("group"))
            if caps is not None and type(caps) is not dict:
                quick = caps._quick.get(name)
                straight = quick is None
                if not straight and tensor_at is not None and not quick[1]:
                    op = (args[op_at] if n > op_at else kwargs.get("op", _SUM)) if op_at is not None else None
                    oid = id(op)  # ReduceOp objects (PREMUL_SUM, ReduceOp(x)) are not canonical: slow path
                    if oid in canonical and oid not in quick[0]:
                        dtypes = quick[2]  # empty when no gap names a dtype: the tensor is not looked at
                        straight = not dtypes or getattr(
                            args[t_pos] if n > t_pos else kwargs.get(t_kw), "dtype", None) not in dtypes
                if straight:
                    # torch.compile traces torch's function itself (it maps it to a functional collective)
                    if compiling():
                        return original(*args, **kwargs)
                    try:
                        work = call(*args, **kwargs)
                    except Exception as error:
                        if logging_layer is None:
                            raise
                        _raise_through(logging_layer, call, error, args, kwargs)
                    return work if work is None else _noted(work, caps)  # async_op=True (comm/inflight.py)
            return _noted(fn(original, *args, **kwargs), caps)

        return _documented(routed, original, name, fn)

    return _named(make, name, fn)


def _noted(work: Any, caps: Any) -> Any:
    """A call's work (``async_op=True``), kept until seen completed where its group runs on host threads
    (comm/inflight.py); ``caps``: the group's capability table, or a dict of them (a rewritten call's)."""
    if work is None or caps is None:
        return work
    tables = caps.values() if type(caps) is dict else (caps,)
    return note_work(work) if any(t is not None and t.groups_hold_host_threads for t in tables) else work


def _route_all_gather(name: str, fn: Callable) -> Callable[[Callable], Callable]:
    """``_route`` for all_gather_into_tensor / all_gather_single, whose gap is a shape, not an op or dtype.

    Where the group's table lists the gap (Gloo, testccl) the hot path compares the
    output's trailing sizes with the input's: equal (chunk-shaped, as Megatron's sequence-
    parallel and parameter all-gathers are) goes straight, otherwise ``fn`` decides
    (``all_gather_into_tensor`` above). Where it does not (NCCL, the stand-in), the call
    goes straight after the same two dict reads as every routed collective. The straight
    call, the logging layer and Dynamo are handled as in ``_route``.
    """
    caps_get = _CAPS.get  # _CAPS is only ever mutated, never rebound
    compiling = torch.compiler.is_dynamo_compiling

    def make(original: Callable) -> Callable:
        call, logging_layer = _torch_logging_layer(original)

        @functools.wraps(original)
        def routed(*args: Any, **kwargs: Any) -> Any:
            n = len(args)
            caps = caps_get(args[2] if n > 2 else kwargs.get("group"))
            if caps is not None and type(caps) is not dict:
                straight = name not in caps._quick
                if not straight:  # the backend wants chunk-shaped outputs: is this one? (1-d: no .shape read)
                    x = args[1] if n > 1 else kwargs.get("input_tensor")
                    out = args[0] if n else kwargs.get("output_tensor")
                    try:
                        d = x.dim()
                        straight = d == out.dim() and (d == 1 or (d > 1 and out.shape[1:] == x.shape[1:]))
                    except AttributeError:  # not tensors: torch's own check answers the call
                        straight = True
                if straight:
                    if compiling():  # torch.compile traces torch's function itself
                        return original(*args, **kwargs)
                    try:
                        work = call(*args, **kwargs)
                    except Exception as error:
                        if logging_layer is None:
                            raise
                        _raise_through(logging_layer, call, error, args, kwargs)
                    return work if work is None else _noted(work, caps)  # async_op=True (comm/inflight.py)
            return _noted(fn(original, *args, **kwargs), caps)

        return _documented(routed, original, name, fn)

    return _named(make, name, fn)


def _documented(routed: Callable, original: Callable, name: str, fn: Callable) -> Callable:
    routed.__doc__ = f"Route torch.distributed.{name} through portspeed.comm.router.{fn.__name__}.\n\n" + (
        original.__doc__ or "")
    return routed


def _named(make: Callable, name: str, fn: Callable) -> Callable:
    make.__name__ = make.__qualname__ = f"route_{name}"
    make.__doc__ = f"Factory: torch.distributed.{name} routed through portspeed.comm.router.{fn.__name__}."
    return make


#: factories ``make(original) -> routed`` for the collectives the router handles, by
#: torch.distributed function name (``reduce_scatter_single`` and ``all_gather_single`` are
#: torch 2.13's names for reduce_scatter_tensor and all_gather_into_tensor; tables use the old names).
COLLECTIVE_ROUTES: dict[str, Callable[[Callable], Callable]] = {
    "all_reduce": _route("all_reduce", all_reduce, (0, "tensor"), 1, 2),
    "reduce": _route("reduce", reduce, (0, "tensor"), 2, 3),
    "reduce_scatter_tensor": _route("reduce_scatter_tensor", reduce_scatter_tensor, (1, "input"), 2, 3),
    "reduce_scatter_single": _route("reduce_scatter_tensor", reduce_scatter_tensor, (1, "input"), 2, 3),
    "reduce_scatter": _route("reduce_scatter", reduce_scatter, (0, "output"), 2, 3),
    "all_to_all": _route("all_to_all", all_to_all, None, None, 2),
    "all_gather_into_tensor": _route_all_gather("all_gather_into_tensor", all_gather_into_tensor),
    "all_gather_single": _route_all_gather("all_gather_into_tensor", all_gather_into_tensor),
}
