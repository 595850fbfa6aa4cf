"""DeepSpeed patches: only what DeepSpeed's accelerator hook does not cover.

DeepSpeed already asks ``get_accelerator()`` for its device and its default collective
backend, so the accelerator object portspeed injects (``portspeed.integrations.ds_accelerator``) does
most of the port. Two things remain, declared here:

- ``deepspeed.accelerator`` (built by ``accelerator_patch`` once DeepSpeed is imported,
  because the object subclasses DeepSpeed's classes): fills DeepSpeed's injection slot,
  ``real_accelerator.ds_accelerator``, the variable ``set_accelerator`` writes, with the
  portspeed-backed object. Declared as a patch so ``portspeed.manager().revert()`` empties
  the slot again and DeepSpeed goes back to its own detection. Inactive on the CUDA adapter,
  where DeepSpeed's own CUDA accelerator (and its kernels) is the right answer.
- ``deepspeed.comm.init_distributed.backend``: an explicit ``dist_backend`` (scripts
  written for GPUs pass ``"nccl"``) overrides the accelerator's backend in DeepSpeed, so
  it is routed to the adapter's backend. Everything else DeepSpeed does there (MPI /
  AzureML / SageMaker discovery, wrapping an already initialised torch.distributed) runs
  unchanged. The route taken is written into this patch's report entry.

Backend names are mapped by the collective router (``portspeed.comm.router.map_backend``) when
it is installed; without it, by the minimal rule in ``route_backend`` below. When the
router's own ``init_process_group`` patch is active the requested name is passed on
untouched, so the router can keep it as the group's requested name (``get_backend()``
then answers ``'nccl'``, as scripts written for GPUs expect).
"""

from __future__ import annotations

import importlib
import logging
import threading
from typing import Any, Callable

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import REPLACE, WRAP, Patch

__all__ = ["PATCHES", "DISTRIBUTION", "VERSIONS", "accelerator_patch", "route_backend", "routes"]

log = logging.getLogger("portspeed.deepspeed")

DISTRIBUTION = "deepspeed"
#: The DeepSpeed releases these patches were written and run against.
VERSIONS = ">=0.19,<0.20"

INIT_PATCH = "deepspeed.comm.init_distributed.backend"
ROUTER_INIT_PATCH = "torch.distributed.init_process_group.backend"
ACCELERATOR_PATCH = "deepspeed.accelerator"

#: Collective backends that belong to one device family; a request for one of them on
#: another device is a GPU-era default, not a choice, so it is routed.
DEVICE_BACKENDS = frozenset({"nccl", "rccl", "hccl", "xccl", "ccl", "cncl", "mccl", "eccl", "tccl", "bccl"})

_lock = threading.Lock()
_routes: list[dict[str, Any]] = []


def _router() -> Any:
    """``portspeed.comm.router`` when it is installed, else None."""
    try:
        return importlib.import_module("portspeed.comm.router")
    except ModuleNotFoundError as exc:
        if exc.name != "portspeed.comm.router":
            raise
        return None


def _router_patch_applied() -> bool:
    """Whether the router's init_process_group patch is installed (it then maps names itself)."""
    import portspeed

    return portspeed.manager().status(ROUTER_INIT_PATCH) == "applied"


def route_backend(requested: str | None) -> str | None:
    """The backend a ``dist_backend`` request runs on, on the active adapter.

    With the collective router installed this is ``portspeed.comm.router.map_backend``. Without
    it, the minimal rule: None stays None (DeepSpeed then asks the accelerator, which
    answers the adapter's backend); a device-family backend (``nccl``, ``hccl``...) other
    than the adapter's becomes the adapter's backend; anything else (``gloo``, ``mpi``, a
    registered third-party backend) is an explicit choice and is kept.
    """
    if requested is not None and (not isinstance(requested, str) or not requested.strip()):
        raise ValueError(
            f"dist_backend={requested!r} is not a backend name; pass a name such as 'nccl' or 'gloo', "
            "or None to use the accelerator's backend"
        )
    router = _router()
    if router is not None:
        return router.map_backend(requested)
    if requested is None:
        return None
    target = get_accelerator().communication_backend
    name = requested.strip().lower()
    if name in DEVICE_BACKENDS and name != target:
        return target
    return requested


def routes() -> list[dict[str, Any]]:
    """Every dist_backend routing this process did: requested, used, and how."""
    with _lock:
        return [dict(r) for r in _routes]


def _note(requested: str | None, used: str | None, how: str) -> None:
    entry = {"requested": requested, "used": used, "how": how}
    with _lock:
        _routes.append(entry)
        seen: list[str] = []
        for r in _routes:
            text = f"dist_backend {r['requested']!r} -> {r['used']!r} ({r['how']})"
            if text not in seen:
                seen.append(text)
    import portspeed

    mgr = portspeed.manager()
    if mgr.status(INIT_PATCH) is not None:
        mgr.note(INIT_PATCH, "; ".join(seen))
    log.info("portspeed: deepspeed.comm.init_distributed dist_backend %r -> %r (%s)", requested, used, how)


def _init_distributed(wrapped: Callable[..., Any], instance: Any, args: tuple, kwargs: dict) -> Any:
    """Route ``dist_backend`` to the adapter's backend, then run DeepSpeed's own init."""
    import torch.distributed as dist

    args = list(args)
    requested = args[0] if args else kwargs.get("dist_backend")
    router = _router()
    if dist.is_available() and dist.is_initialized():
        # DeepSpeed wraps the existing group; its backend was chosen (and routed, when the
        # router's torch.distributed patches are active) by whoever created it.
        used = router.real_backend() if router is not None else dist.get_backend()
        how = "torch.distributed was initialised first; DeepSpeed wraps that group"
    else:
        used = route_backend(requested)
        if used is None:
            used = get_accelerator().communication_backend
        if requested is None:
            how = f"DeepSpeed asks the accelerator: the {get_accelerator().name!r} adapter's backend"
        elif _router_patch_applied():
            # Pass the requested name on: the router's init_process_group maps it and keeps
            # it as the group's requested name, so get_backend() == 'nccl' checks still hold.
            how = "mapped by portspeed.comm.router at init_process_group"
        elif used != requested:
            how = "mapped here (the router's init_process_group patch is not active)"
            if args:
                args[0] = used
            else:
                kwargs["dist_backend"] = used
        else:
            how = "kept: explicit choice"
    _note(requested, used, how)
    return wrapped(*args, **kwargs)


PATCHES: list[Patch] = [
    Patch(
        name=INIT_PATCH,
        target="deepspeed.comm.comm:init_distributed",
        kind=WRAP,
        impl=_init_distributed,
        distribution=DISTRIBUTION,
        versions=VERSIONS,
        reason=("an explicit dist_backend such as 'nccl' overrides the accelerator's backend in DeepSpeed, "
                "so it must be routed to the adapter's backend"),
    ),
]


def accelerator_patch(ds_accelerator: Any) -> Patch:
    """The patch that puts ``ds_accelerator`` in DeepSpeed's injection slot (see the module docstring)."""
    return Patch(
        name=ACCELERATOR_PATCH,
        target="deepspeed.accelerator.real_accelerator:ds_accelerator",
        kind=REPLACE,
        impl=ds_accelerator,
        distribution=DISTRIBUTION,
        versions=VERSIONS,
        when=translated,  # on CUDA DeepSpeed runs natively, with its own accelerator
        reason=("DeepSpeed asks one injected accelerator object for every device answer; portspeed fills "
                "that slot (what deepspeed.accelerator.set_accelerator writes) with an adapter-backed object"),
    )
