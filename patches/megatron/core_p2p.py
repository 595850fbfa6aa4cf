"""Megatron-Core pipeline p2p: refuse the one interleaved layout whose messages cross on Gloo.

With virtual pipeline stages and exactly 2 pipeline ranks, the previous and the next rank
are the same rank, so one batched p2p call holds two sends and two receives between the
same pair. Gloo matches them in posting order and silently swaps activations and
gradients (losses diverge from TP1 with no error; measured in tests/test_megatron_core_parity.py).
Megatron-LM's argument checks forbid this layout, megatron-core alone does not. The
wrapper raises with the fix: ``overlap_p2p_comm=True, batch_p2p_comm=False`` in the model
config (the unbatched even/odd-ordered path), or more than 2 pipeline ranks.

Everything else in ``p2p_communication`` runs through the translation: buffers are
allocated on ``torch.cuda.current_device()`` (the adapter's device) and
``torch.cuda.synchronize()`` after batched ops is the adapter's synchronize.
"""

from __future__ import annotations

from typing import Any

from portspeed.errors import PortspeedError
from portspeed.patch import WRAP, Patch

from .core_common import CORE_DIST, CORE_VERSIONS, not_cuda

__all__ = ["PATCHES", "InterleavedP2PLayoutError"]


class InterleavedP2PLayoutError(PortspeedError, ValueError):
    """Interleaved pipeline with 2 ranks and batched p2p: messages would be matched wrongly."""


def interleaved_guard(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    from megatron.core import parallel_state
    from megatron.core.utils import get_model_config

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


PATCHES: list[Patch] = [
    Patch(name="megatron.core.p2p.interleaved_pp2_guard",
          target="megatron.core.pipeline_parallel.schedules:forward_backward_pipelining_with_interleaving",
          kind=WRAP, impl=interleaved_guard,
          reason="with 2 pipeline ranks, batched interleaved p2p swaps messages silently on Gloo; fail with the fix instead",
          distribution=CORE_DIST, versions=CORE_VERSIONS, when=not_cuda),
]
