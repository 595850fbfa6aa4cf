"""What an adapter declares where its device falls short, checked when the class is defined, and the stated value
``total_memory`` answers for a device that cannot say its memory.

The declarations (``Accelerator.total_memory_bytes``, ``host_generator``, ``wrong_torch_ops``, ``staged_collectives``,
``ccl_verified``) are what
``portspeed conformance`` prints for a device that lacks something; this module refuses one of the wrong kind,
naming the attribute (``check_declarations``), and holds the one degraded answer of the contract's defaults:
``unknown_total_memory`` (the declared figure, else the host's physical memory, said once per adapter).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

__all__ = ["STAGED_BACKEND", "STAGEABLE", "WRITTEN_AS", "check_declarations", "class_label", "groups_backend",
           "host_memory_bytes", "unknown_total_memory"]

#: set by the registry on a module it imports from an adapter file: the file as the user wrote it
WRITTEN_AS = "__portspeed_written_as__"


def class_label(cls: type) -> str:
    """How a message names an adapter class: ``path/zeta.py:Zeta`` for a class from an adapter file (the user's own
    words, not the module name the file is imported under, which they never wrote), else ``module.Class``."""
    written = getattr(sys.modules.get(cls.__module__), WRITTEN_AS, None)
    return f"{written}:{cls.__qualname__}" if written else f"{cls.__module__}.{cls.__qualname__}"

#: portspeed's own c10d backend for any device: each collective staged through the host on Gloo
#: (``portspeed.comm.staged``)
STAGED_BACKEND = "staged"
#: the collectives ``staged_collectives`` may name: each goes through the host on Gloo (``portspeed.comm.staged``)
#: while the others stay on the adapter's own backend (``send_recv``: send, recv and batch_isend_irecv together)
STAGEABLE = ("all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
             "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "gather", "scatter", "send_recv", "barrier")


def check_declarations(cls: type, error: type[Exception]) -> None:
    """Refuse, naming the attribute and what it takes, a declaration of the wrong kind (when the class is defined)."""
    from portspeed.settings import TE_KERNEL_OPS

    where = f"adapter class {class_label(cls)}"
    total = cls.__dict__.get("total_memory_bytes")
    if total is not None and (isinstance(total, bool) or not isinstance(total, int) or total <= 0):
        raise error(f"{where}: total_memory_bytes = {total!r}; give the device's memory in bytes as a positive int "
                    "(or leave it None: ask the device)")
    wrong = cls.__dict__.get("wrong_torch_ops")
    if wrong is not None:
        names = (wrong,) if isinstance(wrong, str) else tuple(wrong)
        from portspeed.accelerator.host_rung import HOST_OPS

        unknown = [n for n in names if n not in TE_KERNEL_OPS and n not in HOST_OPS]
        if unknown:
            raise error(f"{where}: wrong_torch_ops names {', '.join(map(repr, unknown))}, not an operation of the "
                        f"portable Transformer Engine nor a torch op portspeed computes on the host; name some of "
                        f"{', '.join(TE_KERNEL_OPS)} (the TE's other rungs) or {', '.join(HOST_OPS)} (the host)")
        cls.wrong_torch_ops = names
    staged = cls.__dict__.get("staged_collectives")
    if staged is not None:
        names = (staged,) if isinstance(staged, str) else tuple(staged)
        unknown = [n for n in names if n not in STAGEABLE]
        if unknown:
            raise error(f"{where}: staged_collectives names {', '.join(map(repr, unknown))}, not a collective the "
                        f"staged backend serves; name some of {', '.join(STAGEABLE)} (or declare backend = 'staged' "
                        "for all of them)")
        cls.staged_collectives = names
    verified = cls.__dict__.get("ccl_verified")
    if verified is not None and type(verified) is not bool:
        raise error(f"{where}: ccl_verified = {verified!r}; give True (the CCL is proven: no check of its "
                    "collectives when the job's default group is made) or False")


def groups_backend(acc: Any) -> str:
    """The backend the router creates ``acc``'s groups on: its ``communication_backend``, or ``staged`` when it
    declares ``staged_collectives`` (the staged backend then carries its own backend for the other collectives);
    PORTSPEED_BACKEND naming another backend wins."""
    backend = acc.communication_backend
    if acc.staged_collectives and backend.lower() == acc.default_backend().lower():
        return STAGED_BACKEND
    return backend


_warned_memory: set[str] = set()


def host_memory_bytes() -> int:
    """The host's physical memory in bytes (what ``total_memory`` answers for a device that cannot say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not a POSIX host
        return 16 << 30


def unknown_total_memory(acc: Any, index: int, exc: BaseException) -> int:
    """The declared ``total_memory_bytes``, else the host's memory, saying once per adapter what was answered."""
    if acc.total_memory_bytes is not None:
        return int(acc.total_memory_bytes)
    answer = host_memory_bytes()
    if acc.name not in _warned_memory:
        _warned_memory.add(acc.name)
        logging.getLogger("portspeed").warning(
            "portspeed: the %r device cannot say its total memory (%s: %s); answering %d bytes, the host's physical "
            "memory; declare total_memory_bytes = <bytes per device> in %s", acc.name, type(exc).__name__,
            str(exc).splitlines()[0] if str(exc) else "", answer, type(acc).__name__)
    return answer
