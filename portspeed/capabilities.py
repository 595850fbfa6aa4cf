"""Per-backend collective capability tables, by torch version.

FIRST DRAFT (owned by the router work): ``capabilities_for(backend)`` returns a
``Capabilities`` record saying which (collective, reduce-op, dtype) combinations the
backend does right on the installed torch; the router rewrites the rest.
"""

from __future__ import annotations

import dataclasses

import torch.distributed as dist

from .errors import UnknownBackendError

__all__ = ["Capabilities", "KNOWN_BACKENDS", "capabilities_for", "check_backend_name"]

#: Backend names portspeed knows, with the device type they serve.
KNOWN_BACKENDS: dict[str, str] = {
    "gloo": "cpu",
    "nccl": "cuda",
    "hccl": "npu",
    "xccl": "xpu",
    "ccl": "xpu",
    "cncl": "mlu",
    "mccl": "musa",
    "mpi": "cpu",
    "ucc": "cuda",
}


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend gets wrong or lacks; empty sets mean 'does everything right'."""

    backend: str
    missing: frozenset[str] = frozenset()
    notes: tuple[str, ...] = ()


def check_backend_name(name: str) -> None:
    """Raise UnknownBackendError unless ``name`` is a backend portspeed or torch.distributed knows."""
    registered = {b.lower() for b in getattr(dist.Backend, "backend_list", [])}
    if name.lower() not in KNOWN_BACKENDS and name.lower() not in registered:
        known = sorted(set(KNOWN_BACKENDS) | registered)
        raise UnknownBackendError(
            f"unknown collective backend {name!r}; known: {', '.join(known)}. A vendor backend must be "
            "registered with torch.distributed.Backend.register_backend (usually by importing the vendor package) first"
        )


def capabilities_for(backend: str) -> Capabilities:
    return Capabilities(backend=backend)
