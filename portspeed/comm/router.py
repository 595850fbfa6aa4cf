"""The collective router: backend names a framework asks for, and rewrites of what a backend lacks.

Contract
- **Names.** ``map_backend(name)`` turns the backend a framework asks for into the one the
  active adapter uses: accelerator backends of other devices (``nccl``, ``hccl``...) and
  ``None`` become ``get_accelerator().communication_backend``; CPU backends (``gloo``,
  ``mpi``) and backends registered with torch stay; ``"cpu:gloo,cuda:nccl"`` maps each
  pair, the accelerator's backend winning on its own device. Unknown names raise
  UnknownBackendError listing the known ones. On a CUDA adapter with nccl every mapping is
  the identity, so nothing changes.
- **What ``dist.get_backend()`` reports.** The *requested* name: a group created with
  ``backend="nccl"`` answers ``"nccl"`` even though it runs on Gloo, so framework and user
  code that compares ``get_backend() == "nccl"`` keeps its path (two-way mapping). torch's
  own modules (``torch.*`` callers, e.g. ``monitored_barrier``'s Gloo check) get the real
  name. ``real_backend(group)`` always gives the real one.
- **Rewrites.** ``all_reduce``, ``reduce``, ``reduce_scatter``, ``reduce_scatter_tensor``
  (and torch 2.13's ``reduce_scatter_single``) and ``all_to_all`` ask the group's
  capability table about (collective, op, dtype). The table is the active adapter's
  answer for the group's real backend (``Accelerator.capabilities(backend)``: torch's own
  backends' defaults plus the gaps the adapter declares for its backend), resolved once
  per group and cached; collectives
  no table lists a gap for (all_gather, broadcast, p2p...) are not wrapped at all. No gap:
  the original gets the caller's own arguments (hot path: the wrapper checks the op's
  identity and the dtype against small sets cached per group). A gap: the call is rewritten into collectives the backend
  does right (unsupported dtype: compute in float32 and write back; AVG: SUM then divide;
  PREMUL_SUM: scale then SUM; MAX/MIN/PRODUCT reduce_scatter: all_reduce then slice; other
  ops of all_reduce/reduce: all_gather then reduce locally; list reduce_scatter through
  reduce_scatter_tensor; list all_to_all through all_to_all_single). Inner calls go
  through the router again, so gaps compose (on the stand-in, AVG on a bf16 reduce_scatter
  becomes a float32 SUM, divided, then rounded once). Results land in the caller's
  tensors. What cannot be rewritten faithfully (AVG/PREMUL_SUM on integers, float64 on a
  backend that narrows it) raises CollectiveUnsupportedError saying what to do. ``async_op=True`` returns a
  ``RewriteWork`` whose ``wait()`` finishes the rewrite.
- **Counting.** ``stats()`` lists, per collective, how many calls were rewritten and how.
  Straight calls are not counted (that would cost on the hot path).

Limits: inside ``_coalescing_manager`` a rewritten collective runs at once rather than in
the coalesced batch (correct values, less overlap). Functional collectives
(``torch.distributed._functional_collectives``) do not pass through here. The
capability cache is keyed by group and cleared by ``destroy_process_group``.

Example::

    dist.init_process_group("nccl")          # on the CPU adapter: runs Gloo
    dist.get_backend()                       # 'nccl'
    portspeed.comm.router.real_backend()          # 'gloo'
    portspeed.comm.router.stats()                 # {'all_reduce': {'rewrites': 2, 'by': {'avg_as_sum': 2}}}
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from portspeed.comm.capabilities import CANONICAL_OPS, KNOWN_BACKENDS, Capabilities, Gap, capabilities_for, op_type
from portspeed.errors import CollectiveUnsupportedError, UnknownBackendError

__all__ = [
    "RewriteWork",
    "map_backend",
    "real_backend",
    "requested_backend",
    "capabilities_of",
    "use_capabilities",
    "stats",
    "reset_stats",
    "reset",
]

log = logging.getLogger("portspeed.comm.router")

RedOpType = dist.ReduceOp.RedOpType
_SUM = dist.ReduceOp.SUM
_FLOAT32 = torch.float32

# torch 2.13 renamed reduce_scatter_tensor / all_gather_into_tensor (the old names warn and delegate)
_RS_TENSOR = "reduce_scatter_single" if hasattr(c10d, "reduce_scatter_single") else "reduce_scatter_tensor"
_AG_TENSOR = "all_gather_single" if hasattr(c10d, "all_gather_single") else "all_gather_into_tensor"

_CANONICAL_OP_IDS = frozenset(id(v) for v in CANONICAL_OPS.values())

_lock = threading.RLock()
_REQUESTED: dict[Any, str] = {}  # process group -> backend name the caller asked for
_CAPS: dict[Any, Any] = {}  # group (None = default) -> Capabilities or {device_type: Capabilities}
_STATS: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)


# ---------------------------------------------------------------------- names
def _accelerator() -> Any:
    from portspeed.accelerator import get_accelerator

    return get_accelerator()


def _map_one(name: str, acc: Any) -> str:
    target = acc.communication_backend
    low = name.strip().lower()
    if low == target or low in ("gloo", "mpi"):
        return low
    device = KNOWN_BACKENDS.get(low)
    if device is not None:
        if device == "cpu" or device == acc.device_type:
            return low
        return target
    registered = {b.lower() for b in getattr(dist.Backend, "backend_list", [])} - {"undefined"}
    if low in registered:
        return low
    known = sorted(set(KNOWN_BACKENDS) | registered)
    raise UnknownBackendError(
        f"unknown collective backend {name!r}; known: {', '.join(known)}. Pass one of these (or "
        "'device:backend' pairs such as 'cpu:gloo,cuda:nccl'), or register a vendor backend with "
        "torch.distributed.Backend.register_backend first"
    )


def map_backend(requested: str | None, accelerator: Any = None) -> str | None:
    """The backend to create a group with, for the ``requested`` name on the active adapter."""
    acc = accelerator if accelerator is not None else _accelerator()
    target = acc.communication_backend
    if requested is None:
        if acc.device_type == "cuda" and target == "nccl":
            return None  # nothing changes on CUDA: torch picks its own default
        return target
    if not isinstance(requested, str) or not requested.strip():
        raise UnknownBackendError(
            f"backend must be a non-empty string such as 'nccl' or 'cpu:gloo,cuda:nccl', got {requested!r}"
        )
    if ":" not in requested:
        return _map_one(requested, acc)
    pairs: dict[str, str] = {}
    for part in requested.split(","):
        dev, sep, name = part.strip().partition(":")
        if not sep or not dev or not name:
            raise UnknownBackendError(
                f"backend string {requested!r} has a malformed part {part!r}; use 'device:backend' pairs "
                "separated by commas, e.g. 'cpu:gloo,cuda:nccl'"
            )
        dev = dev.strip().lower()
        mapped = _map_one(name, acc)
        if dev == "cuda" and acc.device_type != "cuda":
            dev = acc.device_type
        if dev == acc.device_type and mapped == target:
            pairs[dev] = mapped  # the accelerator's backend wins on its own device
        else:
            pairs.setdefault(dev, mapped)
    if len(pairs) == 1:
        return next(iter(pairs.values()))
    return ",".join(f"{d}:{b}" for d, b in pairs.items())


def _pg(group: Any) -> Any:
    return group if group is not None else c10d._get_default_group()


def real_backend(group: Any = None) -> str:
    """The backend a group really runs on (what torch created), whatever get_backend() reports."""
    pg = _pg(group)
    entry = c10d._world.pg_map.get(pg)
    if entry is None:
        raise ValueError(f"{group!r} is not a process group of this process (or this rank is not in it)")
    return str(entry[0])


def requested_backend(group: Any = None) -> str | None:
    """The backend name the caller asked for when creating ``group`` (None: not recorded)."""
    return _REQUESTED.get(_pg(group))


def _torch_caller() -> bool:
    frame = sys._getframe(2)
    while frame is not None:
        mod = frame.f_globals.get("__name__", "")
        if not (mod.startswith("portspeed") or mod.startswith("wrapt")):
            return mod == "torch" or mod.startswith("torch.")
        frame = frame.f_back
    return False


def _drop_foreign_options(pg_options: Any, asked: Any, mapped: Any) -> Any:
    if pg_options is not None and asked != mapped and "nccl" in type(pg_options).__qualname__.lower():
        log.info("portspeed: dropping %s meant for %r (group runs on %r)", type(pg_options).__name__, asked, mapped)
        return None
    return pg_options


# wrappers for the group-creation entry points (wrapt signature)
def wrap_init_process_group(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Create the default group on the adapter's backend; remember the requested name."""
    args = list(args)
    asked = args[0] if args else kwargs.get("backend")
    mapped = map_backend(asked)
    if args:
        args[0] = mapped
    else:
        kwargs["backend"] = mapped
    if len(args) > 7:
        args[7] = _drop_foreign_options(args[7], asked, mapped)
    elif "pg_options" in kwargs:
        kwargs["pg_options"] = _drop_foreign_options(kwargs["pg_options"], asked, mapped)
    result = wrapped(*args, **kwargs)
    with _lock:
        _CAPS.clear()
        if asked is not None:
            _REQUESTED[c10d._get_default_group()] = str(dist.Backend(asked)) if ":" not in asked else asked.lower()
    return result


def wrap_new_group(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Create a sub-group on the adapter's backend; remember the requested name (or the default's)."""
    args = list(args)
    asked = args[2] if len(args) > 2 else kwargs.get("backend")
    if asked is None:
        mapped = None  # torch uses the default group's real backend
        inherited = _REQUESTED.get(c10d._get_default_group()) if c10d.is_initialized() else None
    else:
        mapped, inherited = map_backend(asked), None
        if len(args) > 2:
            args[2] = mapped
        else:
            kwargs["backend"] = mapped
        if len(args) > 3:
            args[3] = _drop_foreign_options(args[3], asked, mapped)
        elif "pg_options" in kwargs:
            kwargs["pg_options"] = _drop_foreign_options(kwargs["pg_options"], asked, mapped)
    group = wrapped(*args, **kwargs)
    name = asked if asked is not None else inherited
    if name is not None and group is not None and group in c10d._world.pg_map:
        with _lock:
            _REQUESTED[group] = str(dist.Backend(name)) if ":" not in name else name.lower()
    return group


def wrap_get_backend(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Report the requested backend name to framework code, the real one to torch itself."""
    real = wrapped(*args, **kwargs)
    if not _REQUESTED or _torch_caller():
        return real
    group = args[0] if args else kwargs.get("group")
    try:
        asked = _REQUESTED.get(_pg(group))
    except (ValueError, RuntimeError):
        return real
    return asked if asked is not None else real


def wrap_destroy_process_group(wrapped: Callable, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Forget cached capabilities and requested names of destroyed groups."""
    group = args[0] if args else kwargs.get("group")
    result = wrapped(*args, **kwargs)
    with _lock:
        _CAPS.clear()
        if group is None:
            _REQUESTED.clear()
        else:
            _REQUESTED.pop(group, None)
    return result


# ---------------------------------------------------------------------- capabilities per group
def _resolve_caps(group: Any) -> Any:
    """The record for ``group``, asked of the active adapter once (then cached in _CAPS)."""
    try:
        real = real_backend(group)
    except (ValueError, RuntimeError):
        return capabilities_for("unknown")  # not a member: torch itself returns early
    acc = _accelerator()
    if ":" not in real:
        return acc.capabilities(real)
    table = {}
    for part in real.split(","):
        dev, _, name = part.partition(":")
        table[dev.strip()] = acc.capabilities(name.strip())
    return table


def capabilities_of(group: Any = None, device_type: str = "cpu") -> Capabilities:
    """The capability table that applies to collectives on ``group`` for tensors on ``device_type``."""
    caps = _CAPS.get(group)
    if caps is None:
        caps = _CAPS[group] = _resolve_caps(group)
    if type(caps) is dict:
        return caps.get(device_type) or capabilities_for("unknown")
    return caps


def use_capabilities(caps: Capabilities, group: Any = None) -> None:
    """Make ``group`` follow ``caps`` until it is destroyed: for tests that replay another
    torch version's or vendor's table on Gloo (e.g. ``capabilities_for("gloo", "2.7")``)."""
    if not isinstance(caps, Capabilities):
        raise TypeError(f"use_capabilities() takes a Capabilities record, got {type(caps).__name__}")
    with _lock:
        _CAPS[group] = caps
        if group is None and c10d.is_initialized():
            _CAPS[c10d._get_default_group()] = caps


def stats() -> dict[str, dict[str, Any]]:
    """Per collective: how many calls were rewritten, and by which rewrite."""
    with _lock:
        return {k: {"rewrites": sum(c.values()), "by": dict(c)} for k, c in sorted(_STATS.items()) if c}


def reset_stats() -> None:
    """Zero the rewrite counters (tests, benchmarks)."""
    with _lock:
        _STATS.clear()


def reset() -> None:
    """Forget cached tables, requested names and counters."""
    with _lock:
        _CAPS.clear()
        _REQUESTED.clear()
        _STATS.clear()


def _count(collective: str, rewrite: str) -> None:
    with _lock:
        first = _STATS[collective][rewrite] == 0
        _STATS[collective][rewrite] += 1
    if first:  # once per (collective, rewrite): visible in stock Megatron logs, free afterwards
        log.warning("portspeed: the backend lacks this form of %s; rewritten (%s). "
                    "Counts: portspeed.comm.router.stats(); this line is logged once.", collective, rewrite)


# ---------------------------------------------------------------------- async completion
class RewriteWork(dist.Work):
    """The work handle of a rewritten collective: wait() waits for the inner ones, then finishes."""

    def __init__(self, works: list, finish: Callable[[], None], result: Any = None) -> None:
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._finish = finish
        self._result = result
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        if not self._done:
            for w in self._works:
                w.wait()
            self._finish()
            self._done = True
        return True

    def is_completed(self) -> bool:
        return self._done

    def is_success(self) -> bool:
        return self._done

    def get_future(self) -> torch.futures.Future:
        """A completed future (waits first: the rewrite's last step runs in Python)."""
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def result(self) -> Any:
        self.wait()
        return self._result


def _complete(works: list, finish: Callable[[], None], async_op: bool, result: Any = None) -> Any:
    if async_op:
        return RewriteWork(works, finish, result)
    for w in works:
        if w is not None:
            w.wait()
    finish()
    return None


def _nothing() -> None:
    return None


def _in_coalescing(group: Any) -> bool:
    state = getattr(c10d._world, "pg_coalesce_state", None)
    return bool(state) and _pg(group) in state


def _run_rewrite(collective: str, gap: Gap, group: Any, async_op: bool, body: Callable[[bool], Any]) -> Any:
    """Run ``body(async_inner)`` with coalescing handled; count it."""
    if group is not None and c10d._rank_not_in_group(group):
        return None
    if _in_coalescing(group):
        # the coalescing manager records calls and runs them at its exit; a rewrite has
        # steps after its inner calls, so run it now, outside the recorded batch
        pg = _pg(group)
        ops = c10d._world.pg_coalesce_state.pop(pg)
        try:
            body(False)
        finally:
            c10d._world.pg_coalesce_state[pg] = ops
        return RewriteWork([], _nothing) if async_op else None
    return body(async_op)


# ---------------------------------------------------------------------- helpers for rewrites
def _world_size(group: Any) -> int:
    return dist.get_world_size(group)


def _require_float(collective: str, t: torch.Tensor, what: str) -> None:
    if not t.is_floating_point():
        raise CollectiveUnsupportedError(
            f"{collective} with {what} on {t.dtype} tensors: the backend lacks it and portspeed only rewrites it "
            "for floating-point tensors; use SUM and divide yourself, or cast to a float dtype"
        )


def _factor(op: Any) -> Any:
    f = getattr(op, "factor", None)
    if f is None:
        raise CollectiveUnsupportedError(
            f"PREMUL_SUM {op!r} carries no factor; build it with torch.distributed._make_nccl_premul_sum(factor)"
        )
    return f


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


def _gap(collective: str, group: Any, op: Any, tensor: torch.Tensor) -> Gap | None:
    """The capability gap of this call, or None (the hot path)."""
    caps = _CAPS.get(group)
    if caps is None or type(caps) is dict:
        caps = capabilities_of(group, tensor.device.type)
    return caps.gap(collective, op, tensor.dtype)


def _upcast_target(collective: str, gap: Gap, t: torch.Tensor) -> torch.dtype:
    if t.dtype == torch.float64:
        raise CollectiveUnsupportedError(
            f"{collective} on float64: the backend {gap.note!r}; portspeed cannot emulate float64 exactly. "
            "Cast to float32 yourself if that precision is enough"
        )
    return _FLOAT32


def _is_dst(group: Any, dst: Any, group_dst: Any) -> bool:
    if group_dst is not None:
        return dist.get_rank(group) == group_dst
    return dist.get_rank() == dst


# ---------------------------------------------------------------------- routed collectives
def all_reduce(wrapped: Callable, tensor: torch.Tensor, op: Any = _SUM, group: Any = None,
               async_op: bool = False) -> Any:
    """all_reduce through the capability table of ``group``."""
    gap = _gap("all_reduce", group, op, tensor)
    if gap is None:
        return wrapped(tensor, op=op, group=group, async_op=async_op)
    opt = op_type(op)
    n = _world_size(group)

    def body(inner_async: bool) -> Any:
        if gap.dtype is not None:
            _count("all_reduce", "upcast")
            tmp = tensor.to(_upcast_target("all_reduce", gap, tensor))
            w = c10d.all_reduce(tmp, op=op, group=group, async_op=inner_async)
            return _complete([w], lambda: tensor.copy_(tmp), inner_async)
        if opt == RedOpType.AVG:
            _require_float("all_reduce", tensor, "AVG")
            _count("all_reduce", "avg_as_sum")
            w = c10d.all_reduce(tensor, op=_SUM, group=group, async_op=inner_async)
            return _complete([w], lambda: tensor.div_(n), inner_async)
        if opt == RedOpType.PREMUL_SUM:
            _require_float("all_reduce", tensor, "PREMUL_SUM")
            _count("all_reduce", "premul_as_scale_sum")
            tensor.mul_(_factor(op))
            w = c10d.all_reduce(tensor, op=_SUM, group=group, async_op=inner_async)
            return _complete([w], _nothing, inner_async)
        _count("all_reduce", "via_all_gather")
        flat = tensor.reshape(-1).contiguous()
        gathered = flat.new_empty(n * flat.numel())
        w = getattr(c10d, _AG_TENSOR)(gathered, flat, group=group, async_op=inner_async)
        return _complete([w], lambda: tensor.copy_(_local_reduce(gathered.view(n, -1), opt).view_as(tensor)),
                         inner_async)

    return _run_rewrite("all_reduce", gap, group, async_op, body)


def reduce(wrapped: Callable, tensor: torch.Tensor, dst: Any = None, op: Any = _SUM, group: Any = None,
           async_op: bool = False, **kwargs: Any) -> Any:
    """reduce through the capability table of ``group`` (``group_dst`` passes through)."""
    gap = _gap("reduce", group, op, tensor)
    if gap is None:
        return wrapped(tensor, dst, op=op, group=group, async_op=async_op, **kwargs)
    opt = op_type(op)
    n = _world_size(group)
    group_dst = kwargs.get("group_dst")

    def call(t: torch.Tensor, o: Any, inner_async: bool) -> Any:
        return c10d.reduce(t, dst, op=o, group=group, async_op=inner_async, **kwargs)

    def body(inner_async: bool) -> Any:
        mine = _is_dst(group, dst, group_dst)
        if gap.dtype is not None:
            _count("reduce", "upcast")
            tmp = tensor.to(_upcast_target("reduce", gap, tensor))
            w = call(tmp, op, inner_async)
            return _complete([w], lambda: tensor.copy_(tmp) if mine else None, inner_async)
        if opt == RedOpType.AVG:
            _require_float("reduce", tensor, "AVG")
            _count("reduce", "avg_as_sum")
            tmp = tensor.clone()
            w = call(tmp, _SUM, inner_async)
            return _complete([w], lambda: tensor.copy_(tmp.div_(n)) if mine else None, inner_async)
        if opt == RedOpType.PREMUL_SUM:
            _require_float("reduce", tensor, "PREMUL_SUM")
            _count("reduce", "premul_as_scale_sum")
            tmp = tensor * _factor(op)
            w = call(tmp, _SUM, inner_async)
            return _complete([w], lambda: tensor.copy_(tmp) if mine else None, inner_async)
        _count("reduce", "via_all_gather")
        flat = tensor.reshape(-1).contiguous()
        gathered = flat.new_empty(n * flat.numel())
        w = getattr(c10d, _AG_TENSOR)(gathered, flat, group=group, async_op=inner_async)

        def finish() -> None:
            if mine:
                tensor.copy_(_local_reduce(gathered.view(n, -1), opt).view_as(tensor))

        return _complete([w], finish, inner_async)

    return _run_rewrite("reduce", gap, group, async_op, body)


def reduce_scatter_tensor(wrapped: Callable, output: torch.Tensor, input: torch.Tensor, op: Any = _SUM,
                          group: Any = None, async_op: bool = False) -> Any:
    """reduce_scatter_tensor through the capability table of ``group``."""
    gap = _gap("reduce_scatter_tensor", group, op, input)
    if gap is None:
        return wrapped(output, input, op=op, group=group, async_op=async_op)
    opt = op_type(op)
    n = _world_size(group)
    name = "reduce_scatter_tensor"

    def body(inner_async: bool) -> Any:
        if gap.dtype is not None:
            _count(name, "upcast")
            dt = _upcast_target(name, gap, input)
            out32, in32 = output.to(dt), input.to(dt)
            w = getattr(c10d, _RS_TENSOR)(out32, in32, op=op, group=group, async_op=inner_async)
            return _complete([w], lambda: output.copy_(out32), inner_async)
        if opt == RedOpType.AVG:
            _require_float(name, input, "AVG")
            _count(name, "avg_as_sum")
            w = getattr(c10d, _RS_TENSOR)(output, input, op=_SUM, group=group, async_op=inner_async)
            return _complete([w], lambda: output.div_(n), inner_async)
        if opt == RedOpType.PREMUL_SUM:
            _require_float(name, input, "PREMUL_SUM")
            _count(name, "premul_as_scale_sum")
            w = getattr(c10d, _RS_TENSOR)(output, input * _factor(op), op=_SUM, group=group, async_op=inner_async)
            return _complete([w], _nothing, inner_async)
        _count(name, "via_all_reduce_slice")
        tmp = input.reshape(-1).clone()
        w = c10d.all_reduce(tmp, op=op, group=group, async_op=inner_async)
        m, r = output.numel(), dist.get_rank(group)
        return _complete([w], lambda: output.copy_(tmp[r * m:(r + 1) * m].view_as(output)), inner_async)

    return _run_rewrite(name, gap, group, async_op, body)


def reduce_scatter(wrapped: Callable, output: torch.Tensor, input_list: list, op: Any = _SUM,
                   group: Any = None, async_op: bool = False) -> Any:
    """list reduce_scatter through the capability table of ``group``."""
    gap = _gap("reduce_scatter", group, op, output)
    if gap is None:
        return wrapped(output, input_list, op=op, group=group, async_op=async_op)
    opt = op_type(op)
    n = _world_size(group)
    name = "reduce_scatter"

    def body(inner_async: bool) -> Any:
        if gap.dtype is not None:
            _count(name, "upcast")
            dt = _upcast_target(name, gap, output)
            out32 = output.to(dt)
            w = c10d.reduce_scatter(out32, [t.to(dt) for t in input_list], op=op, group=group,
                                    async_op=inner_async)
            return _complete([w], lambda: output.copy_(out32), inner_async)
        if gap.op is not None and opt == RedOpType.AVG:
            _require_float(name, output, "AVG")
            _count(name, "avg_as_sum")
            w = c10d.reduce_scatter(output, input_list, op=_SUM, group=group, async_op=inner_async)
            return _complete([w], lambda: output.div_(n), inner_async)
        if gap.op is not None and opt == RedOpType.PREMUL_SUM:
            _require_float(name, output, "PREMUL_SUM")
            _count(name, "premul_as_scale_sum")
            f = _factor(op)
            w = c10d.reduce_scatter(output, [t * f for t in input_list], op=_SUM, group=group,
                                    async_op=inner_async)
            return _complete([w], _nothing, inner_async)
        _count(name, "via_reduce_scatter_tensor")
        flat_in = torch.cat([t.reshape(-1) for t in input_list])
        flat_out = output.new_empty(output.numel())
        w = getattr(c10d, _RS_TENSOR)(flat_out, flat_in, op=op, group=group, async_op=inner_async)
        return _complete([w], lambda: output.copy_(flat_out.view_as(output)), inner_async)

    return _run_rewrite(name, gap, group, async_op, body)


def all_to_all(wrapped: Callable, output_tensor_list: list, input_tensor_list: list, group: Any = None,
               async_op: bool = False) -> Any:
    """list all_to_all through the capability table of ``group``."""
    probe = input_tensor_list[0] if input_tensor_list else None
    gap = _gap("all_to_all", group, _SUM, probe) if probe is not None else None
    if gap is None:
        return wrapped(output_tensor_list, input_tensor_list, group=group, async_op=async_op)

    def body(inner_async: bool) -> Any:
        _count("all_to_all", "via_all_to_all_single")
        flat_in = torch.cat([t.reshape(-1) for t in input_tensor_list])
        in_splits = [t.numel() for t in input_tensor_list]
        out_splits = [t.numel() for t in output_tensor_list]
        flat_out = flat_in.new_empty(sum(out_splits))
        w = c10d.all_to_all_single(flat_out, flat_in, out_splits, in_splits, group=group, async_op=inner_async)

        def finish() -> None:
            for t, piece in zip(output_tensor_list, flat_out.split(out_splits)):
                t.copy_(piece.view_as(t))

        return _complete([w], finish, inner_async)

    return _run_rewrite("all_to_all", gap, group, async_op, body)


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
                    if compiling():  # torch.compile traces torch's function itself (it maps it to a functional collective)
                        return original(*args, **kwargs)
                    try:
                        return call(*args, **kwargs)
                    except Exception as error:
                        if logging_layer is None:
                            raise
                        _raise_through(logging_layer, call, error, args, kwargs)
            return fn(original, *args, **kwargs)

        routed.__doc__ = f"Route torch.distributed.{name} through portspeed.comm.router.{fn.__name__}.\n\n" + (
            original.__doc__ or "")
        return routed

    make.__name__ = make.__qualname__ = f"route_{name}"
    make.__doc__ = f"Factory: torch.distributed.{name} routed through portspeed.comm.router.{fn.__name__}."
    return make


#: factories ``make(original) -> routed`` for the collectives the router handles, by
#: torch.distributed function name (``reduce_scatter_single`` is torch 2.13's name for
#: reduce_scatter_tensor; tables use the old name).
COLLECTIVE_ROUTES: dict[str, Callable[[Callable], Callable]] = {
    "all_reduce": _route("all_reduce", all_reduce, (0, "tensor"), 1, 2),
    "reduce": _route("reduce", reduce, (0, "tensor"), 2, 3),
    "reduce_scatter_tensor": _route("reduce_scatter_tensor", reduce_scatter_tensor, (1, "input"), 2, 3),
    "reduce_scatter_single": _route("reduce_scatter_tensor", reduce_scatter_tensor, (1, "input"), 2, 3),
    "reduce_scatter": _route("reduce_scatter", reduce_scatter, (0, "output"), 2, 3),
    "all_to_all": _route("all_to_all", all_to_all, None, None, 2),
}
