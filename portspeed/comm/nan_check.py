"""``PORTSPEED_NAN_CHECK=1``: a NaN entering or leaving a collective is named at that collective.

Why: a NaN that one rank feeds into an all_reduce reaches every rank's weights a step later, and
by the time the loss shows it nobody can say where it came from. torch 2.15 checks collective
inputs itself (``NanCheckHook``, attached to every new group with ``TORCH_DIST_NAN_CHECK=1``),
but only on backends whose calls pass through its dispatcher kernels (Gloo, NCCL, a vendor's C++
CCL, the test device's testccl), never on a Python ``ProcessGroup`` (the stand-in, a Python
CCL); it checks no outputs, and its error ("NaN found in input tensor.") names neither the rank,
the collective, the group nor the caller. torch 2.14 and older have no such hook.

Contract (one plain-function frame in front of each checked ``torch.distributed`` function,
installed by ``patches/torch_distributed.py`` only when the switch is on; off, nothing is installed):
- Inputs: where torch's hook serves the group (torch >= 2.15, ``TORCH_DIST_NAN_CHECK=1`` when the
  group was made, a C++ backend) torch checks them, and its error is re-raised as
  ``CollectiveNaNError`` naming the rest; elsewhere portspeed checks them (``torch.isnan``) before
  the call is issued. ``before_init`` sets ``TORCH_DIST_NAN_CHECK=1`` before the first group
  unless the user set it (``0`` keeps torch's hook off, and portspeed then checks inputs itself
  only where torch has no hook: set it to 1 or leave it unset).
- Outputs: checked by portspeed on every backend, when a synchronous call returns or when an
  asynchronous call's work is waited (``CheckedWork``; a result read through ``get_future()``
  alone is not checked).
- What counts as input or output follows the collective: broadcast's and scatter's input only
  on the source, reduce's and gather's output only on the destination, broadcast's output only
  off the source; send checks its input, recv its output. Not checked: ``batch_isend_irecv``,
  the coalesced forms, torch's functional collectives, calls made by a recorded or rewritten
  collective inside it.
- One line, raised as ``CollectiveNaNError`` on the rank that holds the NaN: the rank, input or
  output, the op, the group (name, description, ranks), the caller's ``file:line``, which
  tensor, how many NaN, and who found it (torch's hook or portspeed). A rank that raises before
  issuing its call leaves its peers waiting in that collective until the launcher ends them (as
  torch's own check does).

Relation to the probe's NaN search (``PORTSPEED_PROBE_NAN``, ``portspeed.probe``): the probe
watches module (or op) outputs and gradients between collectives and names the first module that
turned non-finite; this switch watches the collectives themselves, so a NaN that crosses ranks is
named at the call that carried it. Both can be on.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any, Callable

import torch

from portspeed.comm.work import ThenWork
from portspeed.errors import PortspeedError

__all__ = ["NAN_CHECK_ENV", "TORCH_NAN_ENV", "CHECKED", "CollectiveNaNError", "CheckedWork", "enabled",
           "before_init", "checked", "torch_checks_inputs"]

NAN_CHECK_ENV = "PORTSPEED_NAN_CHECK"
#: torch's own switch (torch >= 2.15): NanCheckHook on every group made while it is "1"
TORCH_NAN_ENV = "TORCH_DIST_NAN_CHECK"

# name -> (input argument, where its input counts, output argument, where its output counts, root argument);
# where: "all" ranks, "root" only, "others" (all but the root); None: no such side
CHECKED: dict[str, tuple[str | None, str, str | None, str, str | None]] = {
    "all_reduce": ("tensor", "all", "tensor", "all", None),
    "reduce": ("tensor", "all", "tensor", "root", "dst"),
    "broadcast": ("tensor", "root", "tensor", "others", "src"),
    "all_gather": ("tensor", "all", "tensor_list", "all", None),
    "all_gather_into_tensor": ("input_tensor", "all", "output_tensor", "all", None),
    "all_gather_single": ("input_tensor", "all", "output_tensor", "all", None),
    "reduce_scatter_tensor": ("input", "all", "output", "all", None),
    "reduce_scatter_single": ("input", "all", "output", "all", None),
    "reduce_scatter": ("input_list", "all", "output", "all", None),
    "all_to_all_single": ("input", "all", "output", "all", None),
    "all_to_all": ("input_tensor_list", "all", "output_tensor_list", "all", None),
    "gather": ("tensor", "all", "gather_list", "root", "dst"),
    "scatter": ("scatter_list", "root", "tensor", "all", "src"),
    "send": ("tensor", "all", None, "all", None),
    "isend": ("tensor", "all", None, "all", None),
    "recv": (None, "all", "tensor", "all", None),
    "irecv": (None, "all", "tensor", "all", None),
}

#: torch's message for a NaN its NanCheckHook found (torch 2.15, ``c10d::check_for_nan``)
_TORCH_NAN_MESSAGE = "NaN found in input tensor"
#: frames that are not the caller: torch.distributed's own, portspeed's collective wrappers (the router's, the
#: recorder's), wrapt
_PLUMBING = (os.sep + os.path.join("torch", "distributed") + os.sep,
             os.sep + os.path.join("portspeed", "comm") + os.sep, os.sep + os.path.join("portspeed", "trace") + os.sep,
             os.sep + "wrapt" + os.sep, os.path.join("patches", "torch_distributed.py"))


class CollectiveNaNError(PortspeedError):
    """A collective's input or output on this rank holds NaN (``PORTSPEED_NAN_CHECK``)."""


def enabled() -> bool:
    """Whether PORTSPEED_NAN_CHECK asks for the check (read from portspeed's settings)."""
    from portspeed import config

    return config.settings().nan_check


def before_init() -> None:
    """Before the first group: ask torch (>= 2.15) to attach its NanCheckHook to every group, unless the user chose."""
    if enabled() and _torch_has_hook() and TORCH_NAN_ENV not in os.environ:
        os.environ[TORCH_NAN_ENV] = "1"


def _torch_has_hook() -> bool:
    from torch.distributed import distributed_c10d as c10d

    return hasattr(c10d, "NanCheckHook")


def torch_checks_inputs(group: Any) -> bool:
    """Whether torch's NanCheckHook checks this group's inputs: torch >= 2.15, its switch on, a C++ backend (a Python
    ``ProcessGroup`` subclass never reaches the dispatcher kernels the hook runs in)."""
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d.GroupMember.WORLD
    return _torch_has_hook() and os.environ.get(TORCH_NAN_ENV) == "1" and type(pg) is c10d.ProcessGroup


def _tensors(x: Any) -> list:
    if x is None:
        return []
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for t in x if isinstance(t, torch.Tensor)]
    return []


def _nan_counts(x: Any) -> list[tuple[int, torch.Tensor, int]]:
    """(index, tensor, NaN count) of each floating tensor in ``x`` that holds NaN."""
    out = []
    for i, t in enumerate(_tensors(x)):
        if (t.is_floating_point() or t.is_complex()) and t.numel():
            n = int(torch.isnan(t).sum().item())
            if n:
                out.append((i, t, n))
    return out


def _caller() -> str:
    """The first frame outside torch.distributed and portspeed's wrappers, as ``file:line``."""
    f = sys._getframe(2)
    while f is not None and any(p in f.f_code.co_filename for p in _PLUMBING):
        f = f.f_back
    return "?" if f is None else f"{os.path.basename(f.f_code.co_filename)}:{f.f_lineno}"


def _group_words(group: Any) -> str:
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    pg = group if group is not None else c10d.GroupMember.WORLD
    try:
        name = c10d._get_process_group_name(pg)
        desc = getattr(pg, "group_desc", "") or ("default_pg" if group is None else "")
        ranks = dist.get_process_group_ranks(pg)
    except Exception:  # a group torch does not know: say so rather than fail the check
        return "group ? (unknown to torch.distributed)"
    return f"group {name}" + (f" ({desc})" if desc else "") + f", ranks {ranks}"


def _message(side: str, name: str, bound: dict, found: list, site: str, who: str) -> str:
    import torch.distributed as dist

    rank = dist.get_rank() if dist.is_initialized() else int(os.environ.get("RANK", "0") or 0)
    i, t, n = found[0]
    which = f"tensor {i} of the list" if isinstance(bound.get(CHECKED[name][0 if side == "input" else 2]),
                                                       (list, tuple)) else "the tensor"
    more = f" (and {len(found) - 1} more tensor(s) of the list)" if len(found) > 1 else ""
    hint = ("; its inputs on this rank held none: another rank's input or the reduction brought it"
            if side == "output" and name in ("all_reduce", "reduce", "reduce_scatter", "reduce_scatter_tensor",
                                             "reduce_scatter_single") else "")
    return (f"NaN in the {side} of {name} on rank {rank} ({_group_words(bound.get('group'))}) at {site}: {which} "
            f"{list(t.shape)} {str(t.dtype).replace('torch.', '')} holds {n} NaN of {t.numel()}{more}{hint} "
            f"(found by {who}; PORTSPEED_NAN_CHECK=1)")


def _is_root(bound: dict, root_arg: str | None) -> bool:
    import torch.distributed as dist

    if root_arg is None:
        return True
    root = bound.get(root_arg)
    if root is None:
        local = bound.get(f"group_{root_arg}")
        group = bound.get("group")
        if local is None:
            root = 0
        else:
            root = dist.get_global_rank(group, local) if group is not None else local
    return dist.get_rank() == root


#: an asynchronous collective's work whose ``wait()`` also checks the outputs (once)
CheckedWork = ThenWork


def checked(name: str) -> Callable[[Callable], Callable]:
    """A factory ``make(inner) -> checked`` (``style="function"``) that checks ``name``'s inputs and outputs."""
    in_arg, in_where, out_arg, out_where, root_arg = CHECKED[name]

    def make(inner: Callable) -> Callable:
        try:
            sig = inspect.signature(inner)
        except (TypeError, ValueError):  # no signature to bind: nothing can be told apart, pass through
            return inner

        def nan_checked(*args: Any, **kwargs: Any) -> Any:
            try:
                bound = sig.bind(*args, **kwargs).arguments
            except TypeError:  # torch's own error for bad arguments, not ours
                return inner(*args, **kwargs)
            root = _is_root(bound, root_arg) if root_arg else True
            group = bound.get("group")
            check_in = in_arg is not None and (in_where == "all" or root)
            torch_in = check_in and torch_checks_inputs(group)
            if check_in and not torch_in:
                found = _nan_counts(bound.get(in_arg))
                if found:
                    raise CollectiveNaNError(_message("input", name, bound, found, _caller(), "portspeed"))
            try:
                out = inner(*args, **kwargs)
            except RuntimeError as error:
                if torch_in and _TORCH_NAN_MESSAGE in str(error):
                    found = _nan_counts(bound.get(in_arg)) or [(0, _tensors(bound.get(in_arg))[0], 0)]
                    raise CollectiveNaNError(_message("input", name, bound, found, _caller(),
                                                      "torch's NanCheckHook")) from error
                raise
            check_out = out_arg is not None and (out_where == "all" or (out_where == "root") == root)
            if not check_out:
                return out
            site = _caller()

            def check() -> None:
                found = _nan_counts(bound.get(out_arg))
                if found:
                    raise CollectiveNaNError(_message("output", name, bound, found, site, "portspeed"))

            if out is not None and hasattr(out, "wait") and not isinstance(out, (bool, int)):
                return CheckedWork(out, check)
            check()
            return out

        nan_checked.__name__ = nan_checked.__qualname__ = getattr(inner, "__name__", name)
        nan_checked.__doc__ = f"torch.distributed.{name}, NaN-checked by portspeed.comm.nan_check.\n\n" + (
            inner.__doc__ or "")
        nan_checked.__wrapped__ = inner  # type: ignore[attr-defined]
        return nan_checked

    make.__name__ = make.__qualname__ = f"nan_check_{name}"
    return make
