"""torch.distributed entry points routed through ``portspeed.comm``.

Group creation (``portspeed.comm.groups``) maps the backend a framework asks for
(``nccl``, ``cpu:gloo,cuda:nccl``) to the active adapter's backend; ``get_backend``
reports the requested name back to non-torch callers; the collectives that some
backend's capability table lists gaps for are rewritten where the table says so and go
straight through otherwise (``portspeed.comm.router.COLLECTIVE_ROUTES``). Megatron and
DeepSpeed both end in these functions, and ``torch.distributed.<name>`` (re-exported
with ``from .distributed_c10d import *``) is rebound by the manager to the same chain.
"""

from __future__ import annotations

from portspeed.patching.record import WRAP, Patch
from portspeed.comm import groups, nan_check, router, work
from portspeed.trace import wrappers as trace_wrappers
from portspeed.trace import funcol as trace_funcol
from portspeed.trace import flight_recorder as trace

__all__ = ["PATCHES"]

_MOD = "torch.distributed.distributed_c10d"
_FUNCOL = "torch.distributed._functional_collectives"  # DTensor / TP / FSDP2's collectives: recorded when tracing
_TORCH = ">=2.6"

_COLLECTIVE_REASONS = {
    "all_reduce": "Gloo before torch 2.8 and vendor CCLs lack AVG/PREMUL_SUM or some dtypes; rewrite only those calls.",
    "reduce": "Gloo before torch 2.8 and vendor CCLs lack AVG/PREMUL_SUM or some dtypes; rewrite only those calls.",
    "reduce_scatter_tensor": "Gloo before torch 2.9 silently sums for AVG/MAX, which corrupts averaged gradients; "
                             "rewrite those calls.",
    "reduce_scatter_single": "torch 2.13's name for reduce_scatter_tensor (the old name delegates to it); "
                             "same rewrites.",
    "reduce_scatter": "Gloo has no list reduce_scatter before torch 2.8 and ignores the op on 2.8; "
                      "rewrite those calls.",
    "all_to_all": "Gloo has no list all_to_all before torch 2.12; send it through all_to_all_single.",
    "all_gather_into_tensor": "Gloo wants each output chunk shaped as the input where NCCL only counts elements "
                              "(Megatron's gather_split_1d_tensor passes a flat output); view such outputs as chunks.",
    "all_gather_single": "torch 2.13's name for all_gather_into_tensor (the old name delegates to it); same view.",
}

_NEW_NAMES = ("reduce_scatter_single", "all_gather_single")  # torch 2.13's names
_TRACING = trace.enabled()  # PORTSPEED_TRACE > 0: record every call below (portspeed.trace.flight_recorder)
_NAN_CHECK = nan_check.enabled()  # PORTSPEED_NAN_CHECK: a NaN into or out of a collective raised there
#: recorded only (no routing): the collectives and point-to-point calls the router leaves alone
_RECORDED = ("broadcast", "barrier", "all_gather", "gather", "scatter", "all_to_all_single", "send", "recv",
             "isend", "irecv")

PATCHES: list[Patch] = [
    Patch(
        name="torch.distributed.init_process_group.backend",
        target=f"{_MOD}:init_process_group",
        kind=WRAP,
        impl=groups.wrap_init_process_group,
        distribution="torch",
        versions=_TORCH,
        reason="Frameworks ask for nccl; create the default group on the active adapter's backend instead.",
    ),
    Patch(
        name="torch.distributed.new_group.backend",
        target=f"{_MOD}:new_group",
        kind=WRAP,
        impl=groups.wrap_new_group,
        distribution="torch",
        versions=_TORCH,
        reason="Megatron and DeepSpeed create sub-groups with backend='nccl'; map them to the adapter's backend.",
    ),
    Patch(
        name="torch.distributed.get_backend.requested",
        target=f"{_MOD}:get_backend",
        kind=WRAP,
        impl=groups.wrap_get_backend,
        distribution="torch",
        versions=_TORCH,
        reason="Code that tests get_backend() == 'nccl' must keep its path after the group was mapped to another "
               "backend.",
    ),
    Patch(
        name="torch.distributed.destroy_process_group.forget",
        target=f"{_MOD}:destroy_process_group",
        kind=WRAP,
        impl=groups.wrap_destroy_process_group,
        distribution="torch",
        versions=_TORCH,
        reason="Destroyed groups must drop out of the router's capability cache and name map.",
    ),
    Patch(
        name="torch.distributed._coalescing_manager.empty_batch",
        target=f"{_MOD}:_coalescing_manager",
        kind=WRAP,
        impl=work.wrap_coalescing_manager,
        distribution="torch",
        versions=">=2.6,<2.8",
        reason="Before torch 2.8 a coalescing batch with nothing recorded ends in UnboundLocalError; the router "
               "runs rewritten calls outside the batch, so a batch of rewritten calls (Megatron's AVG gradient "
               "reduce-scatter on Gloo or a CCL without AVG) must end as later releases end it.",
    ),
] + [
    Patch(
        name=f"torch.distributed.{fn}.route",
        target=f"{_MOD}:{fn}",
        kind=WRAP,
        impl=trace_wrappers.traced(fn, router.COLLECTIVE_ROUTES[fn]) if _TRACING else router.COLLECTIVE_ROUTES[fn],
        style="function",
        distribution="torch",
        versions=">=2.13" if fn in _NEW_NAMES else _TORCH,
        reason=_COLLECTIVE_REASONS[fn],
    )
    for fn in ("all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter_single", "reduce_scatter",
               "all_to_all", "all_gather_into_tensor", "all_gather_single")
] + ([
    Patch(
        name=f"torch.distributed.{fn}.trace",
        target=f"{_MOD}:{fn}",
        kind=WRAP,
        impl=trace_wrappers.traced(fn) if fn != "batch_isend_irecv" else trace_wrappers.traced_batch,
        style="function",
        distribution="torch",
        versions=_TORCH,
        reason="PORTSPEED_TRACE is on: record the call (group, sequence number, shapes, caller) for `portspeed "
               "why-hung`.",
    )
    for fn in (*_RECORDED, "batch_isend_irecv")
] if _TRACING else []) + ([
    Patch(
        name=f"torch.distributed._functional_collectives.{fn}.trace",
        target=f"{_FUNCOL}:{fn}",
        kind=WRAP,
        impl=trace_funcol.traced(fn),
        style="function",
        distribution="torch",
        versions=since,
        reason="PORTSPEED_TRACE is on: DTensor, TP and FSDP2 call torch's functional collectives, which never pass "
               "through the functions above; record them too (wait_tensor: when a result is waited, its call is "
               "completed).",
    )
    for fn, since in trace_funcol.RECORDED.items()
] if _TRACING else []) + ([
    Patch(
        name=f"torch.distributed.{fn}.nan_check",
        target=f"{_MOD}:{fn}",
        kind=WRAP,
        impl=nan_check.checked(fn),
        style="function",
        order=10,  # outermost: a call refused for a NaN input is never routed nor recorded
        distribution="torch",
        versions=">=2.13" if fn in _NEW_NAMES else _TORCH,
        reason="PORTSPEED_NAN_CHECK is on: a NaN in this collective's input or output is raised here, naming the "
               "rank, op, group and caller (torch >= 2.15's NanCheckHook checks C++ backends' inputs; portspeed "
               "the rest).",
    )
    for fn in nan_check.CHECKED
] if _NAN_CHECK else [])
