"""Megatron-Core pipeline p2p: refuse the one interleaved layout whose messages cross on Gloo.

With virtual pipeline stages and exactly 2 pipeline ranks, the previous and the next rank
are the same rank, so one batched p2p call holds two sends and two receives between the
same pair. Gloo matches them in posting order and silently swaps activations and
gradients (losses diverge from TP1 with no error; measured in tests/test_megatron_core_parity.py).
Megatron-LM's argument checks forbid this layout, megatron-core alone does not. The
wrapper raises with the fix: ``overlap_p2p_comm=True, batch_p2p_comm=False`` in the model
config (the unbatched even/odd-ordered path), or more than 2 pipeline ranks. A forward-only
pass (evaluation, ``forward_only=True``) sends no gradients, so each batched call holds one
send and one receive, which cannot cross: it goes through (Megatron's own
``pipeline_parallel/test_pipeline_layout.py`` runs forward-only with PP2 and virtual stages
and gives the single-rank losses).

Megatron frees a stage's output right after posting its send (``deallocate_output_tensor``
swaps the tensor's storage for a 1-element one; on by default in Megatron-LM). With NCCL the
send captured the data when it was queued on the stream; a host backend (Gloo, the
stand-in) reads the tensor while the send is in flight, so it sent the swapped storage:
stock PP2 with virtual stages gave wrong, run-to-run different losses. On such backends
(``Capabilities.sends_from_buffer``: Gloo, the stand-in) the p2p ops send a private copy,
kept alive by the send's work object; a backend that takes the data when the send is
issued (NCCL, the test device's staging CCL) needs no copy and the patch is inactive.

Everything else in ``p2p_communication`` runs through the translation: buffers are
allocated on ``torch.cuda.current_device()`` (the adapter's device) and
``torch.cuda.synchronize()`` after batched ops is the adapter's synchronize.
"""

from __future__ import annotations

from typing import Any

from portspeed.accelerator.conditions import sends_from_buffer, translated
from portspeed.errors import PortspeedError
from portspeed.patching.record import WRAP, Patch

from .ranges import CORE, DISTRIBUTION

__all__ = ["PATCHES", "InterleavedP2PLayoutError"]


class InterleavedP2PLayoutError(PortspeedError, ValueError):
    """Interleaved pipeline with 2 ranks and batched p2p: messages would be matched wrongly."""


def interleaved_guard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

    if kwargs.get("forward_only"):  # no gradients travel back: one send and one receive per batched call
        return wrapped(*args, **kwargs)
    model = kwargs.get("model")
    chunks = model if isinstance(model, list) else [model]
    if chunks and chunks[0] is not None:
        config = get_model_config(chunks[0])
        pg = kwargs.get("pg_collection")
        pp = pg.pp.size() if pg is not None and getattr(pg, "pp", None) is not None else \
            parallel_state.get_pipeline_model_parallel_world_size()
        if pp == 2 and getattr(config, "batch_p2p_comm", False) and not getattr(config, "overlap_p2p_comm", False):
            raise InterleavedP2PLayoutError(
                "interleaved pipeline schedule with 2 pipeline ranks and batch_p2p_comm=True: the two sends "
                "between the same pair of ranks are matched in posting order and activations and gradients "
                "get swapped. Set overlap_p2p_comm=True and batch_p2p_comm=False in the model config, "
                "or use more than 2 pipeline ranks"
            )
    return wrapped(*args, **kwargs)


def send_private_copies(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Send copies, so freeing the caller's tensor after posting the send cannot change what is sent."""
    for key in ("tensor_send_prev", "tensor_send_next"):
        t = kwargs.get(key)
        if t is not None:
            kwargs[key] = t.clone()
    return wrapped(*args, **kwargs)


_SEND_COPY_REASON = ("Megatron frees a stage output right after posting its send, which NCCL has already captured; "
                     "a host backend still reads it, so send a private copy")

PATCHES: list[Patch] = [
    Patch(name="megatron.core.p2p.send_copy", target="megatron.core.pipeline_parallel.p2p_communication:_p2p_ops",
          kind=WRAP, impl=send_private_copies, reason=_SEND_COPY_REASON,
          distribution=DISTRIBUTION, versions=CORE, when=sends_from_buffer),
    Patch(name="megatron.core.p2p.send_copy_batched",
          target="megatron.core.pipeline_parallel.p2p_communication:_batched_p2p_ops",
          kind=WRAP, impl=send_private_copies, reason=_SEND_COPY_REASON,
          distribution=DISTRIBUTION, versions=CORE, when=sends_from_buffer),
    Patch(name="megatron.core.p2p.interleaved_pp2_guard",
          target="megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
          kind=WRAP, impl=interleaved_guard,
          reason="with 2 pipeline ranks, batched interleaved p2p swaps messages silently on Gloo; "
                 "fail with the fix instead",
          distribution=DISTRIBUTION, versions=CORE, when=translated),
]
