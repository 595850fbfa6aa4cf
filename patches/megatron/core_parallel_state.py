"""Megatron-Core process-group set-up: NCCL-only options made harmless off CUDA.

``initialize_model_parallel`` can build ``ProcessGroupNCCL.Options`` (communicator config
YAML, high-priority streams), SHARP groups and a separate NCCL/UCC pipeline backend. On a
non-CUDA adapter those have no meaning; the wrapper drops them with one log line each,
so every sub-group inherits the default group's backend (the adapter's, via the
collective router). Backend *names* are the router's business (patches/torch_distributed.py);
only when the router is not installed does this wrapper map an explicit NCCL/UCC pipeline
backend to the default.
"""

from __future__ import annotations

import importlib.util
import logging
from typing import Any

from portspeed.accelerator import get_accelerator
from portspeed.accelerator.conditions import translated
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "sanitize_parallel_kwargs"]

log = logging.getLogger("portspeed.megatron")

#: keyword -> (value that means "off", why it is turned off)
_NCCL_ONLY = {
    "nccl_communicator_config_path": (None, "NCCL communicator configs apply to NCCL groups only"),
    "high_priority_stream_groups": (None, "high-priority NCCL streams apply to NCCL groups only"),
    "use_sharp": (False, "SHARP in-network reduction is an NCCL/InfiniBand feature"),
    "sharp_enabled_group": (None, "SHARP in-network reduction is an NCCL/InfiniBand feature"),
}


def _router_installed() -> bool:
    return importlib.util.find_spec("portspeed.patches.torch_distributed") is not None


def sanitize_parallel_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Return ``kwargs`` with NCCL-only options off (logged), for a non-CUDA adapter."""
    acc = get_accelerator()
    out = dict(kwargs)
    for key, (off, why) in _NCCL_ONLY.items():
        if key in out and out[key] not in (off, None, False, [], ()):
            log.warning("portspeed: initialize_model_parallel(%s=%r) ignored on %r: %s",
                        key, out[key], acc.name, why)
            out[key] = off
    backend = out.get("pipeline_model_parallel_comm_backend")
    if backend in ("nccl", "ucc") and not _router_installed():
        log.warning("portspeed: pipeline_model_parallel_comm_backend=%r mapped to the default backend (%s) on %r",
                    backend, acc.communication_backend, acc.name)
        out["pipeline_model_parallel_comm_backend"] = None
    return out


def initialize_model_parallel(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Drop NCCL-only options before Megatron creates its groups."""
    return wrapped(*args, **sanitize_parallel_kwargs(kwargs))


PATCHES: list[Patch] = [
    Patch(name="megatron.core.parallel_state.nccl_options",
          target="megatron.core.parallel_state:initialize_model_parallel", kind=WRAP, impl=initialize_model_parallel,
          reason="NCCL communicator options, SHARP and an NCCL pipeline backend cannot be created on another "
                 "adapter's backend",
          distribution=DISTRIBUTION, versions=CORE, when=translated),
]
