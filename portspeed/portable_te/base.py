"""What every portable Transformer Engine module shares: parameter placement and ``_extra_state``.

Why: Megatron builds TE modules with ``device=torch.cuda.current_device()`` (an index, which the
translated ``torch.cuda`` answers for the active adapter) or ``"cpu"`` / ``"meta"``, and its
checkpoints carry one ``<module>._extra_state`` entry per TE module (Transformer Engine keeps its
fp8 scaling state there). The portable modules place parameters on the adapter's device and
keep an empty extra state, so checkpoints keep the keys Megatron expects; a checkpoint written
by NVIDIA's Transformer Engine with fp8 scaling state loads, and one log line says that state is
not used (there is no fp8 here).
"""

from __future__ import annotations

import contextlib
import io
import logging
from typing import Any, Callable

import torch

from portspeed.translation.torch_namespace import translate_device

__all__ = ["PortableModule", "resolve_device", "set_tp_attributes", "tracker_fork"]

log = logging.getLogger("portspeed.portable_te")
_said: set[str] = set()


def resolve_device(device: Any) -> torch.device:
    """The device parameters go on: a CUDA index / name becomes the active adapter's device; None the adapter's."""
    if device is None:
        device = "cuda"
    out = translate_device(device)
    return out if isinstance(out, torch.device) else torch.device(out)


def set_tp_attributes(param: torch.Tensor, is_parallel: bool, dim: int, stride: int = 1) -> None:
    """The attributes Megatron reads on tensor-parallel parameters (grad norms, checkpoints, finalize)."""
    param.tensor_model_parallel = is_parallel  # type: ignore[attr-defined]
    param.partition_dim = dim  # type: ignore[attr-defined]
    param.partition_stride = stride  # type: ignore[attr-defined]


def tracker_fork(get_rng_state_tracker: Callable | None, name: str | None = None) -> Any:
    """The RNG tracker's fork TE initialises weights in (``name``: ``rng_tracker_name``); none without a tracker."""
    if get_rng_state_tracker is None:
        return contextlib.nullcontext()
    tracker = get_rng_state_tracker()
    return tracker.fork(name) if name else tracker.fork()


class PortableModule(torch.nn.Module):
    """A torch module with Transformer Engine's ``_extra_state`` contract (empty: no fp8 metadata)."""

    def get_extra_state(self) -> torch.Tensor:
        """An empty uint8 tensor, as Transformer Engine stores when no fp8 state exists."""
        return torch.empty(0, dtype=torch.uint8)

    def set_extra_state(self, state: Any) -> None:
        """Accept what TE or this module saved; fp8 scaling state (non-empty) is not used, said once."""
        if state is None:
            return
        if isinstance(state, io.BytesIO):
            empty = state.getbuffer().nbytes == 0
        elif isinstance(state, torch.Tensor):
            empty = state.numel() == 0
        else:
            empty = not state
        if not empty and "extra_state" not in _said:
            _said.add("extra_state")
            log.warning("portspeed: a checkpoint's Transformer Engine _extra_state (fp8 scaling metadata) is not "
                        "used by the portable Transformer Engine, which has no fp8")


#: Megatron config field -> (option, how to avoid it): options Megatron applies outside the TE layers (fp8 through
#: fp8_utils, which does not see the portable TE), so the layers must refuse them or they would be ignored
CONFIG_REFUSALS: dict[str, tuple[str, str]] = {
    "fp8": ("fp8 training (--fp8-format)", "drop --fp8-format"),
    "fp4": ("fp4 training (--fp4-format)", "drop --fp4-format"),
    "fp8_param": ("fp8 parameters (--fp8-param-gather)", "drop --fp8-param-gather"),
    "tp_comm_overlap": ("tensor-parallel communication overlap with userbuffers (--tp-comm-overlap)",
                        "drop --tp-comm-overlap"),
    "cpu_offloading": ("CPU offload hooks (--cpu-offloading)", "drop --cpu-offloading"),
}


def check_config(module: Any) -> None:
    """Refuse what the Megatron config of a TE wrapper (``self.config``, set before TE's __init__) asks for."""
    from .refuse import refuse_if

    config = module.__dict__.get("config")
    if config is None:
        return
    for field, (option, avoid) in CONFIG_REFUSALS.items():
        refuse_if(getattr(config, field, None), option, avoid)
