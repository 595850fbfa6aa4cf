"""Op-level recording of collectives and point-to-point calls, through portspeed's own wrappers.

Why wrappers: ``torch.distributed.all_reduce`` is not a torch function, so the op-level mode
(``portspeed.probe.ops``) never sees it, and a dispatch mode would not see a Python
``ProcessGroup`` backend (the stand-in CCL) either. ``patches/probe.py`` puts ``recorded(name)``
in front of each of ``torch.distributed``'s functions when op-level probing is configured (and
only then); the wrapper does nothing but call through unless an iteration is being recorded.

Each call becomes ``Distributed.<name>.<c>.forward``: ``input_args`` / ``input_kwargs`` with every
tensor's statistics before the call (the group as its ranks, the reduce op by name), ``output``
with the statistics of every tensor argument after it (what the collective wrote): at once for a
blocking call, at ``wait()`` for ``async_op=True`` (the caller gets a ``ProbedWork`` whose
``wait()`` waits on the real work, then records). Nothing else is changed: the same call, the
same arguments, the same order. A call made inside a recorded one (torch 2.13's old names
delegate to the new ones) is passed straight through. A ``batch_isend_irecv``'s operations are recorded as
msprobe writes a ``P2POp`` (``{class_type, tensor, op, peer, group}``). Calls while autograd's engine runs
(backward's collectives) are not recorded, as for the ops; a pipeline stage's receive made before its
micro-batch's forward carries the micro-batch before it (-1 for the first). A call inside a
``_coalescing_manager`` batch runs when the batch closes: its entry has its inputs, ``"ps_coalesced": true``
and no output.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.distributed as dist

from portspeed.comm.work import ThenWork

__all__ = ["ProbedWork", "RECORDED", "Slot", "recorded", "set_target"]

#: the functions wrapped (those present in the running torch)
RECORDED = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "all_gather_single",
            "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "all_to_all", "all_to_all_single",
            "gather", "scatter", "send", "recv", "isend", "irecv", "batch_isend_irecv")

class Slot:
    """Where one recorder plugs into the wrappers: the probe's (``set_target``) and the perf recording's
    (``portspeed.perf.collectives``) each have their own, so both can wrap the same calls at once."""

    __slots__ = ("target", "busy")

    def __init__(self) -> None:
        #: the iteration being recorded: an object with ``collective(name, args, kwargs) -> finish``; None: off
        self.target: Any = None
        self.busy = False  # inside a recorded call: a call it makes (an old name delegating) is passed through


#: the probe's slot
_SLOT = Slot()


def set_target(target: Any) -> None:
    """Start (an iteration's recorder) or stop (None) recording collectives."""
    _SLOT.target = target


#: the handle of a recorded ``async_op=True`` call: ``wait()`` waits on the real one, then records
ProbedWork = ThenWork


@functools.lru_cache(maxsize=None)
def recorded(name: str, slot: Slot = _SLOT, prefix: str = "probe") -> Callable[[Callable], Callable]:
    """A factory ``make(original) -> wrapper`` (``style="function"``) recording ``name`` while ``slot`` has a
    target (default: the probe's). One factory per (name, slot, prefix): a patch declared twice in a process
    (the Megatron and the DeepSpeed integrations both take the collectives) is then the same record, not a clash."""

    def make(original: Callable) -> Callable:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            target = slot.target
            if target is None or slot.busy:
                return original(*args, **kwargs)
            slot.busy = True
            try:
                finish = target.collective(name, args, kwargs)
                out = original(*args, **kwargs)
            finally:
                slot.busy = False
            if finish is None:
                return out
            if name == "batch_isend_irecv":
                works = list(out or [])
                if not works:
                    finish()
                    return out
                return [ProbedWork(w, finish if i == len(works) - 1 else (lambda: None)) for i, w in enumerate(works)]
            if out is not None and isinstance(out, dist.Work):
                return ProbedWork(out, finish)
            finish()
            return out

        return wrapper

    make.__name__ = make.__qualname__ = f"{prefix}_{name}"
    return make


class CollectiveRecorder:
    """One iteration's ``Distributed.*`` entries (the target ``set_target`` takes)."""

    def __init__(self, record: Any, innermost: Callable[[], Any], ops: Any, parallel: Any) -> None:
        self.record, self.innermost, self.ops, self.parallel = record, innermost, ops, parallel
        self.counts: dict[str, int] = {}
        self.parents: dict[str, str | None] = {}

    def collective(self, name: str, args: tuple, kwargs: dict) -> Callable[[], None] | None:
        """Queue the inputs' statistics now; the function that records the outputs (at once or at wait())."""
        import torch

        from portspeed.probe import ops, stats
        from portspeed.probe.entries import encode

        rec = self.record
        if torch._C._current_graph_task_id() != -1 or not rec.full:
            return None
        c = self.counts.get(name, 0)
        self.counts[name] = c + 1
        key = f"Distributed.{name}.{c}.forward"
        save = rec.saves(key)
        tensors = _tensors(args) + _tensors(tuple(kwargs.values()))

        def tensor(v: torch.Tensor, field: str, i: int) -> dict[str, Any]:
            if ops._UNWRITTEN and ops._unwritten(v):  # a receive buffer from torch.empty: nothing to measure
                return dict(stats.describe(v), **stats.empty_stats(), ps_uninitialized=True)
            return rec.tensor(v, key, field, i, None, save)

        def arg(v: Any, field: str, i: int) -> Any:
            if isinstance(v, torch.Tensor):
                return tensor(v, field, i)
            if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) or type(x).__name__ == "P2POp"
                                                    for x in v):
                return [arg(x, f"{field}.{i}", j) for j, x in enumerate(v)]
            if type(v).__name__ == "P2POp":
                return {"class_type": "torch.distributed.P2POp", "tensor": tensor(v.tensor, field, i),
                        "op": getattr(v.op, "__name__", str(v.op)), "peer": v.peer, "group": encode(v.group)}
            return encode(v)

        where = self.innermost()
        entry: dict[str, Any] = {"ps_micro_batch": rec.micro_batch, "ps_chunk": rec.chunk, "ps_phase": "forward",
                                 "ps_op": name, "ps_op_index": -1, "ps_call": -1, "ps_module": None, "ps_class": None,
                                 "ps_local_path": None, "ps_layer": -1,
                                 "input_args": [arg(a, "input_args", i) for i, a in enumerate(args)],
                                 "input_kwargs": {k: arg(v, f"input_kwargs.{k}", 0) for k, v in kwargs.items()}}
        if where is not None:
            info, call = where
            entry.update(ps_module=info.path, ps_class=info.cls, ps_local_path=info.local_path, ps_call=call,
                         ps_layer=info.layer if info.layer is not None else -1)
            self.parents[key] = f"Module.{info.path}.{info.cls}.forward.{call}"
            if self.ops is not None:
                entry["ps_op_index"] = self.ops.next_index(where)
                self.ops.mark_reduced()
        else:
            self.parents[key] = None
        rec.add(key, entry)

        if _coalescing():  # issued at the batch's end, which this call cannot see: no output recorded
            entry["ps_coalesced"] = True
            entry["output"] = []
            return None

        def finish() -> None:
            for t in tensors:  # written by the collective (a receive buffer is no longer garbage)
                ops._UNWRITTEN.discard(t.untyped_storage().data_ptr())
            entry["output"] = [rec.tensor(t, key, "output", i, None, save, fresh=True) for i, t in enumerate(tensors)]

        return finish


def _coalescing() -> bool:
    """Whether a ``_coalescing_manager`` batch is open (its calls run when the batch closes)."""
    from torch.distributed import distributed_c10d as c10d

    state = getattr(getattr(c10d, "_world", None), "pg_coalesce_state", None)
    return bool(state) and any(state.values())


def _tensors(values: tuple) -> list:
    import torch

    out: list = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out.extend(_tensors(tuple(v)))
        elif type(v).__name__ == "P2POp":
            out.append(v.tensor)
    return out
