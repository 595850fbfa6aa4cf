"""``destroy_model_parallel`` also destroys the groups it forgets on backends that hold host threads.

Why: Megatron's ``destroy_model_parallel`` sets its group globals to None but destroys
only its explicit Gloo twins (``_DATA_PARALLEL_GROUP_GLOO`` and the like); the groups it
asked for with ``backend='nccl'`` stay registered in torch.distributed. On CUDA that costs
little (NCCL communicators are created lazily). Where portspeed routes those groups to
Gloo, each one keeps its Gloo worker threads and sockets alive: every
``initialize_model_parallel`` after a ``destroy_model_parallel`` adds about 50 threads per
rank (8 ranks, TP/PP/DP groups), which wake periodically. Megatron-LM's own unit tests
re-initialise before almost every test (``test_schedules.py`` ~60 times), and 8 ranks with
~2,000 idle Gloo threads each saturated a 2-core machine (load average above 1,000;
docs/megatron-unit-tests.md). Megatron already treats destroying its Gloo groups as part of
``destroy_model_parallel``; this patch extends that to the groups that *are* Gloo here.

What: before Megatron's function runs, the process groups held in
``megatron.core.parallel_state``'s module globals (plain, in lists, tuples or dicts) are
collected; after it, those still registered (not the default group) whose real backend
keeps host threads per group (``Capabilities.groups_hold_host_threads``: Gloo, the test
device's testccl, which stages each group through its own Gloo group)
are destroyed with ``torch.distributed.destroy_process_group``. Groups on other backends
(NCCL, a vendor CCL that does not declare it) are left as Megatron leaves them. Gated
``when=groups_hold_host_threads``: the adapter's own backend declares it. On the test
device each dropped group had kept its staging Gloo threads: ``test_parallel_state.py``
piled up about 1,300 threads per rank before this covered testccl.
"""

from __future__ import annotations

import sys
from typing import Any

from portspeed.accelerator.conditions import groups_hold_host_threads
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "destroy_host_groups", "groups_in"]

_MOD = "megatron.core.parallel_state"


def groups_in(namespace: dict[str, Any]) -> list[Any]:
    """The ProcessGroup objects held by ``namespace``'s values, one level into lists, tuples and dicts."""
    from torch.distributed import ProcessGroup

    found: dict[int, Any] = {}

    def take(v: Any) -> None:
        if isinstance(v, ProcessGroup):
            found.setdefault(id(v), v)

    for value in list(namespace.values()):
        if isinstance(value, (list, tuple)):
            for v in value:
                take(v)
        elif isinstance(value, dict):
            for v in value.values():
                take(v)
        else:
            take(value)
    return list(found.values())


def destroy_host_groups(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """wrapt wrapper of ``destroy_model_parallel``: then destroy the host-thread groups it dropped."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from portspeed.comm.groups import holds_host_threads

    mod = sys.modules.get(_MOD)
    held = groups_in(vars(mod)) if mod is not None and dist.is_initialized() else []
    result = wrapped(*args, **kwargs)
    if not held or not dist.is_initialized():
        return result
    default = c10d._get_default_group()
    for group in held:
        if group is default or group not in c10d._world.pg_map:
            continue
        if holds_host_threads(group):
            dist.destroy_process_group(group)
    return result


PATCHES: list[Patch] = [
    Patch(name="megatron.core.parallel_state.destroy_host_groups", target=f"{_MOD}:destroy_model_parallel",
          kind=WRAP, impl=destroy_host_groups, distribution=DISTRIBUTION, versions=CORE, when=groups_hold_host_threads,
          reason="destroy_model_parallel forgets its 'nccl' groups without destroying them; routed to Gloo or a CCL "
          "staging through Gloo each keeps worker threads and sockets, ~50 threads per rank per re-initialisation; "
          "destroy those, as Megatron does its own Gloo twins"),
]
