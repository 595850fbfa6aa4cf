"""Megatron-Core defaults that need a CUDA kernel fall back to the torch path, with one log line each.

On a non-CUDA adapter ``TransformerConfig.__post_init__`` turns off the options whose only
implementation is a CUDA kernel (or apex / Transformer Engine, which have no CPU build),
before Megatron validates the config; ``portspeed.megatron_adaptor.note_fallback`` logs
each one once per process. ``WrappedTorchNorm`` (the torch LayerNorm used without apex)
accepts ``sequence_parallel`` by marking its parameters the way Megatron's fused norms do,
so ``finalize_model_grads`` all-reduces their gradients across the tensor-parallel group.
"""

from __future__ import annotations

import copy
from typing import Any

from portspeed.patching.record import WRAP, Patch

from .core_common import CORE_DIST, CORE_VERSIONS, not_cuda

__all__ = ["FALLBACKS", "PATCHES"]

#: config field -> why it falls back (the torch path computes the same function).
FALLBACKS: dict[str, str] = {
    "masked_softmax_fusion": "scaled_masked_softmax_cuda is a CUDA extension; torch softmax is used",
    "persist_layer_norm": "the persistent LayerNorm is an apex CUDA kernel; torch LayerNorm is used",
    "memory_efficient_layer_norm": "memory-efficient LayerNorm is an apex CUDA kernel; torch LayerNorm is used",
    "gradient_accumulation_fusion": "fused_weight_gradient_mlp_cuda is a CUDA extension; weight grads accumulate in torch",
    "bias_activation_fusion": "bias-gelu/swiglu fusion compiles a CUDA/Triton kernel; unfused torch ops are used",
    "bias_dropout_fusion": "bias-dropout-add fusion compiles a CUDA/Triton kernel; unfused torch ops are used",
    "apply_rope_fusion": "fused RoPE is a Transformer Engine / CUDA kernel; torch RoPE is used",
    "cross_entropy_loss_fusion": "fused cross entropy compiles a CUDA/Triton kernel; torch cross entropy is used",
}


def config_post_init(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Turn CUDA-kernel-only options off before Megatron's own validation runs."""
    from portspeed.megatron_adaptor import note_fallback

    for field, why in FALLBACKS.items():
        if getattr(instance, field, False):
            object.__setattr__(instance, field, False)
            note_fallback(field, why)
    return wrapped(*args, **kwargs)


def torch_norm_new(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """WrappedTorchNorm(config, ...) with sequence_parallel: build the norm, mark its params sequence-parallel."""
    config = args[0] if args else kwargs.get("config")
    if config is None or not getattr(config, "sequence_parallel", False):
        return wrapped(*args, **kwargs)
    plain = copy.copy(config)
    object.__setattr__(plain, "sequence_parallel", False)
    if args:
        args = (plain,) + tuple(args[1:])
    else:
        kwargs = dict(kwargs, config=plain)
    norm = wrapped(*args, **kwargs)
    for p in norm.parameters():
        setattr(p, "sequence_parallel", True)
    return norm


_COMMON = dict(distribution=CORE_DIST, versions=CORE_VERSIONS, when=not_cuda)

PATCHES: list[Patch] = [
    Patch(name="megatron.core.fallbacks.config", target="megatron.core.transformer.transformer_config:TransformerConfig.__post_init__",
          kind=WRAP, impl=config_post_init,
          reason="options whose only implementation is a CUDA kernel must fall back to the torch path off CUDA",
          **_COMMON),
    Patch(name="megatron.core.fallbacks.torch_norm_sp", target="megatron.core.transformer.torch_norm:WrappedTorchNorm",
          kind=WRAP, impl=torch_norm_new,
          reason="without apex the torch LayerNorm refuses sequence parallelism; mark its params so their grads are all-reduced over TP",
          **_COMMON),
]
