"""The portable Transformer Engine's kernel calls at ``--probe-level op``: one ``Kernel.<op>.<c>.forward`` entry each.

Why: a fused operation (attention, rms_norm, rope, swiglu, grouped_mm, ...) would otherwise show
in an op dump as whatever torch functions its implementation happens to call: the device's own
operators under a vendor kernel, ``F.rms_norm`` under torch's, the written-out arithmetic under
the reference. Two runs of one model would then list different ops (and shift every later op's
counter), and ``portspeed precheck`` could not tell which operation to replay. So while the op
recorder is on, the kernel registry's one dispatch point (``portspeed.portable_te.kernels.kernel``)
hands each kernel out wrapped here: its call becomes one entry, keyed to the innermost module like
any op, with the operation's inputs (keyword arguments included), its outputs and ``ps_impl``
(``vendor`` | ``torch`` | ``reference``: the implementation that ran). The torch functions called
inside the kernel are NOT recorded (the entry stands for them: nothing is counted twice, and a
vendor run lists the same ops as a CPU run). Calls made while autograd's engine runs (a kernel's
backward, recompute re-runs) are not recorded, as for every op.

The wrapper only observes: it calls the kernel with the caller's arguments and returns its result;
the statistics are queued under ``no_grad`` with torch-function handling off (``stats``). A wrapper
kept past the iteration (a caller that holds the kernel) calls straight through.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.utils._pytree import tree_flatten

if TYPE_CHECKING:
    from portspeed.probe.ops import OpRecorder

__all__ = ["FAMILY", "observe"]

#: the key family of a kernel call (``Kernel.<op>.<c>.forward``; msprobe reads the family as an API name)
FAMILY = "Kernel"


def observe(recorder: "OpRecorder | None") -> None:
    """Record the portable TE's kernel calls into ``recorder`` from now on (None: stop)."""
    from portspeed.portable_te import kernels

    kernels.observer = None if recorder is None else functools.partial(_wrapped, recorder)


def _wrapped(recorder: "OpRecorder", op: str, impl: str, fn: Callable) -> Callable:
    """``fn`` (the kernel serving ``op``, implementation ``impl``) recording each call into ``recorder``."""

    def call(*args: Any, **kwargs: Any) -> Any:
        if not recorder.on or torch._C._current_graph_task_id() != -1:
            return fn(*args, **kwargs)  # stopped, autograd's engine, or a kernel called inside a kernel
        where = recorder.innermost()
        if where is not None and not recorder.selected(where[0]):
            return fn(*args, **kwargs)
        rec = recorder.record
        c = recorder.counts.get((FAMILY, op), 0)
        key = f"{FAMILY}.{op}.{c}.forward"
        save = rec.saves(key)
        recorder.on = False  # the torch functions inside the kernel are the kernel's: not recorded
        try:
            out = fn(*args, **kwargs)
        finally:
            recorder.on = True
        pending = recorder._inputs(key, args, kwargs, save)  # kernels do not write their inputs: read after
        recorder.counts[(FAMILY, op)] = c + 1
        recorder._add(key, op, where, pending, tree_flatten(out)[0], save)
        entry = rec.entries.get(key)  # absent where only the NaN watch's flags are taken
        if entry is not None:
            entry["ps_impl"] = impl
        return out

    call.__ps_served__ = fn  # type: ignore[attr-defined]  (kernels.served: identity checks see the kernel)
    call.__name__ = getattr(fn, "__name__", op)
    return call
