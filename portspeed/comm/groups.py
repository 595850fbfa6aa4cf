"""Process groups: the wrappers of torch's group entry points, and each group's capability table.

Why: a group is where a requested backend name meets the one that runs, and where the
router learns once which calls that backend gets wrong. The wrappers here (wrapt
signature, wired by ``portspeed.patches.torch_distributed``) create groups on the
adapter's backend, report the requested name back, and keep the per-group cache the hot
path reads (``_CAPS``) in step with the groups that exist.

Contract
- ``init_process_group`` / ``new_group``: the backend is mapped (``backends.map_backend``),
  NCCL-only ``pg_options`` meant for another backend are dropped, the requested name is
  remembered (a sub-group created without a backend inherits the default group's name); the default
  group's collectives are checked once on small tensors (``ccl_check``: a wrong CCL stops the job there);
  a group whose real backend is Gloo is created lazily (``gloo_init.lazy_gloo``: its ranks
  connect at its first collective), unless ``PORTSPEED_GLOO_LAZY_INIT=0`` or the user set
  ``TORCH_GLOO_LAZY_INIT``.
- ``get_backend``: framework and user code gets the *requested* name, torch's own modules
  (``torch.*`` callers, e.g. ``monitored_barrier``'s Gloo check) the real one.
- ``destroy_process_group``: forgets the group's name and clears the capability cache.
- ``capabilities_of(group, device_type)``: the active adapter's record for the group's real
  backend (``Accelerator.capabilities(backend)``), asked once per group and cached;
  ``use_capabilities`` makes a group follow another record (tests replaying other tables);
  ``holds_host_threads(group)``: whether that record says the group keeps host threads.

Limits: ``_CAPS`` is keyed by group (None = the default group, as callers pass it) and is
only ever mutated, never rebound: the routed collectives hold its bound ``get``.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, Callable

from torch.distributed import distributed_c10d as c10d

from portspeed.accelerator.declarations import STAGED_BACKEND
from portspeed.comm import backends, ccl_check, nan_check, staged
from portspeed.trace import torch_recorder as trace_torch
from portspeed.comm.backends import _REQUESTED, _accelerator, _pg, map_backend, real_backend
from portspeed.accelerator.capabilities import Capabilities, capabilities_for
from portspeed.comm.gloo_init import lazy_gloo

__all__ = [
    "capabilities_of",
    "holds_host_threads",
    "use_capabilities",
    "wrap_init_process_group",
    "wrap_new_group",
    "wrap_get_backend",
    "wrap_destroy_process_group",
]

log = logging.getLogger("portspeed.comm.router")

_lock = threading.RLock()
#: group (None = default) -> Capabilities, or {device_type: Capabilities} for 'cpu:gloo,xpu:xccl' groups
_CAPS: dict[Any, Any] = {}


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


# ---------------------------------------------------------------------- wrappers (wrapt signature)
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
    _register_staged(mapped)
    trace_torch.before_init(mapped)  # PORTSPEED_TRACE on NCCL: torch's own flight recorder too (set before the group)
    nan_check.before_init()  # PORTSPEED_NAN_CHECK on torch >= 2.15: torch's NanCheckHook on every group it makes
    with lazy_gloo(mapped):
        result = wrapped(*args, **kwargs)
    with _lock:
        _CAPS.clear()
        if asked is not None:
            backends.remember(c10d._get_default_group(), asked)
    ccl_check.check_default_group(_accelerator())  # a wrong CCL stops the job here (PORTSPEED_CCL_CHECK)
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
    _register_staged(mapped)
    with lazy_gloo(mapped if mapped is not None else _default_real()):
        group = wrapped(*args, **kwargs)
    name = asked if asked is not None else inherited
    if name is not None and group is not None and group in c10d._world.pg_map:
        with _lock:
            backends.remember(group, name)
    return group


def _register_staged(mapped: Any) -> None:
    """Register portspeed's ``staged`` backend for the adapter's device when a group is made on it."""
    if isinstance(mapped, str) and STAGED_BACKEND in mapped.lower():
        staged.register(_accelerator().device_type)


def _default_real() -> str | None:
    """The default group's real backend (what a sub-group created without a backend runs on)."""
    try:
        return real_backend(None) if c10d.is_initialized() else None
    except (ValueError, RuntimeError):
        return None


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
        backends.forget(group)
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


def holds_host_threads(group: Any) -> bool:
    """Whether ``group`` runs (for any device type) on a backend that keeps host threads per group."""
    capabilities_of(group)  # resolves the group's table(s) once and caches them in _CAPS
    entry = _CAPS.get(group)
    tables = entry.values() if type(entry) is dict else [entry]
    return any(t is not None and t.groups_hold_host_threads for t in tables)


def use_capabilities(caps: Capabilities, group: Any = None) -> None:
    """Make ``group`` follow ``caps`` until it is destroyed: for tests that replay another
    torch version's or vendor's table on Gloo (e.g. ``capabilities_for("gloo", "2.7")``)."""
    if not isinstance(caps, Capabilities):
        raise TypeError(f"use_capabilities() takes a Capabilities record, got {type(caps).__name__}")
    with _lock:
        _CAPS[group] = caps
        if group is None and c10d.is_initialized():
            _CAPS[c10d._get_default_group()] = caps


def forget_all() -> None:
    """Forget every cached table and requested name (``portspeed.comm.reset``)."""
    with _lock:
        _CAPS.clear()
        backends.forget(None)
